"""What dividing gradients by the world size costs: as a pass of its own after the copy
into the bucket, or done by the copy itself. ResNet-18's gradients, one thread.

    python docs/data/cpu/divide_while_copying.py
"""
import time

import torch
import torchvision


def main():
    torch.set_num_threads(1)
    params = list(torchvision.models.resnet18(num_classes=10).parameters())
    grads = [torch.randn_like(p) for p in params]
    flat = torch.zeros(sum(p.numel() for p in params))
    slots, offset = [], 0
    for p in params:
        slots.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()

    def copy_then_divide():
        for slot, grad in zip(slots, grads):
            slot.copy_(grad)
        flat.div_(4)

    def divide_while_copying():
        for slot, grad in zip(slots, grads):
            torch.div(grad, 4, out=slot)

    for way in [copy_then_divide, divide_while_copying] * 2:
        for _ in range(3):
            way()
        started = time.thread_time()
        for _ in range(20):
            way()
        print(f"{way.__name__:22s} {(time.thread_time() - started) / 20 * 1e3:5.2f} ms CPU")


if __name__ == "__main__":
    main()
