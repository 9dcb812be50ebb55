"""What a GPU does in the time the cost model gives it (docs/cost_model.md, "Clusters we do not have").

    python docs/data/gpu/measure.py --json gpu.jsonl

The model's GPU cluster (docs/data/model/gpu_cluster.json) was written by hand: a step of 32
images takes 16 ms for ResNet-18 and 80 ms for ResNet-50, reductions run at 1 TB/s. This
measures, on the GPU at hand:

- a training step (forward, backward, SGD) of 32 images, ResNet-18 and ResNet-50, on the
  bench's 28x28 one-channel images (the model the traces came from) and on 224x224 RGB
  (ImageNet's), in float32 (TF32 off, then on) and under bf16 autocast;
- a reduction `a += b` on the GPU, in bytes of `a` per second (the model's gamma);
- host-to-device and device-to-host copies, pageable and pinned: what gloo and mpi pay to
  stage a CUDA tensor through host memory.

Each figure is the median of timed repeats after warm-up, timed with CUDA events.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from trainer.tasks.resnets import build_model


def cuda_ms(fn, repeats: int, warmup: int = 5) -> float:
    """Median milliseconds of `fn()` on the GPU, each call timed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_rows(batch: int, repeats: int):
    for arch in ("resnet18", "resnet50"):
        for channels, classes, size in ((1, 10, 28), (3, 1000, 224)):
            for precision in ("fp32", "tf32", "bf16"):
                torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
                torch.backends.cudnn.allow_tf32 = precision == "tf32"
                model = build_model(arch, channels, classes, size).cuda()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                images = torch.randn(batch, channels, size, size, device="cuda")
                labels = torch.randint(0, classes, (batch,), device="cuda")

                def step():
                    optimizer.zero_grad(set_to_none=True)
                    with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
                        loss = F.cross_entropy(model(images), labels)
                    loss.backward()
                    optimizer.step()

                grad_mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
                yield dict(what="step", arch=arch, image=f"{channels}x{size}x{size}",
                           batch=batch, precision=precision, gradient_mb=round(grad_mb, 1),
                           ms=round(cuda_ms(step, repeats), 3))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def reduction_rows(repeats: int):
    for mib in (1, 16, 256):
        a = torch.randn(mib << 18, device="cuda")
        b = torch.randn_like(a)
        ms = cuda_ms(lambda: a.add_(b), repeats)
        yield dict(what="reduce", mib=mib, ms=round(ms, 4),
                   gb_per_s=round(a.numel() * 4 / ms / 1e6, 1))


def copy_rows(repeats: int):
    for mib in (1, 16, 256):
        device = torch.empty(mib << 18, device="cuda")
        for pinned in (False, True):
            host = torch.empty(mib << 18, pin_memory=pinned)
            for direction, fn in (("h2d", lambda: device.copy_(host)),
                                  ("d2h", lambda: host.copy_(device))):
                ms = cuda_ms(fn, repeats)
                yield dict(what="copy", direction=direction, pinned=pinned, mib=mib,
                           ms=round(ms, 4), gb_per_s=round(mib * 2**20 / ms / 1e6, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="append one JSON line per figure to this file")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("measure.py: needs a CUDA GPU")
    header = dict(what="device", name=torch.cuda.get_device_name(), torch=torch.__version__,
                  cudnn=torch.backends.cudnn.version())
    print(json.dumps(header))
    out = open(args.json, "a") if args.json else None
    for rows in (step_rows(args.batch, args.repeats), reduction_rows(args.repeats),
                 copy_rows(args.repeats)):
        for row in rows:
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(dict(header, **row)) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
