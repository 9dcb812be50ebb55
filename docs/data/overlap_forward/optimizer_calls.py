"""What stepping layer by layer costs in CPU against one optimizer call: SGD with
momentum over ResNet-18's parameters (the trainer.bench model), once as one call and
once as a call per layer (what step_in_forward.py does: a shallow copy of the optimizer
given one layer's parameters at a time), one thread, as each rank runs.
    python docs/data/overlap_forward/optimizer_calls.py"""
import copy
import time

import torch

from trainer.tasks.resnets import build_model

REPEATS = 20


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("resnet18", 1, 10, 28)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer.step()  # the momentum buffers exist from here on
    layers = [own for own in (list(m.parameters(recurse=False)) for m in model.modules())
              if own]
    part = copy.copy(optimizer)

    def per_layer():
        for own in layers:
            part.param_groups = [dict(optimizer.param_groups[0], params=own)]
            part.step()

    for name, step in [("one call", optimizer.step), (f"{len(layers)} calls", per_layer)] * 2:
        started = time.process_time()
        for _ in range(REPEATS):
            step()
        print(f"{name:>9}: {(time.process_time() - started) / REPEATS * 1e3:5.1f} ms of CPU a step")


if __name__ == "__main__":
    main()
