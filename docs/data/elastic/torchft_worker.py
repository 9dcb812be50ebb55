"""One replica of torchft's fault-tolerant DDP: the third way docs/elastic.md compares
(torchft.sh runs one per emulated host, each under a torchrun that restarts it).

The same model, data, optimizer and learning-rate schedule as the trainer, from the
trainer's own flags (--dataset, --data-dir, --train-samples, --test-samples, --epochs,
--batch-size, --lr, --momentum, --weight-decay, --seed, --timeout, --metrics), trained
the way torchft's train_ddp.py trains:

    Manager        one per host, each host a replica group of one rank. Before every
                   step (OptimizerWrapper.zero_grad) it joins a quorum at the lighthouse
                   (torchft_lighthouse, on the switch: $TORCHFT_LIGHTHOUSE); a new quorum
                   reconfigures its gloo group in place, and a replica behind the others
                   (a restarted one) first receives their model and optimizer state
                   (healing, over HTTP).
    DDP            torchft's DistributedDataParallel: every bucket all-reduced through
                   the Manager, which notes a failure instead of raising it. Its hook
                   is replaced (SurvivingDDP): torchft 0.2.0's own fails at the first
                   failed all-reduce, on the fault it is there for (below).
    commit         OptimizerWrapper.step() steps only where the Manager says every
                   replica's step succeeded (should_commit); a failed step is trained
                   again in the next quorum.
    data           torchft's DistributedSampler: a fixed shard per replica
                   ($REPLICA_GROUP_ID of $NUM_REPLICA_GROUPS), each step the next batch
                   of it. A replica that is not in the quorum leaves its shard's
                   batches untrained (torchft's documented behaviour).
    restarts       a replica that cannot reach the quorum (its quorum call raises) exits;
                   its torchrun starts it again, and it heals from the others.

One line per event, for the logs torchft.sh stamps: a quorum of another size, a step
not committed, the first commit after it, each epoch (evaluated by the quorum's
replica 0, on the whole test split).

    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=4 TORCHFT_LIGHTHOUSE=http://switch:29510 \\
        python docs/data/elastic/torchft_worker.py --dataset mnist --data-dir ../shared/data
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo  # noqa: E402
from torchft.data import DistributedSampler  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

from trainer.tasks import image_data as data  # noqa: E402
from trainer.loop.cli import build_parser  # noqa: E402
from trainer.loop.dynamic_shards import cosine_decay  # noqa: E402
from trainer.tasks.resnets import build_model  # noqa: E402
from trainer.loop.checkpoint import seed_everything  # noqa: E402


class SurvivingDDP(DistributedDataParallel):
    """torchft's DistributedDataParallel with a comm hook that outlives a failed step.

    torchft 0.2.0's hook returns the Manager's future chain (`fut._fut`), which a failed
    all-reduce leaves unset: `assert fut._fut` raises in backward and the replica dies.
    After that, the Manager's dummy work has a plain future with no `_fut` at all
    (AttributeError; meta-pytorch/torchft#304). Measured here: at a killed host, every
    survivor died so, and their torchruns started them all again from step 0. This hook
    waits for the bucket's all-reduce (the Manager averages it in place, or notes the
    failure, which makes should_commit() refuse the step) and hands the bucket back."""

    @staticmethod
    def _comm_hook(manager, bucket):  # no annotations: torch checks them as types
        manager.allreduce(bucket.buffer()).wait()
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


def say(*words) -> None:
    print(*words, flush=True)


def evaluate(model: torch.nn.Module, test_set) -> float:
    """Test accuracy of `model` over the whole test split."""
    correct = 0
    model.eval()
    with torch.no_grad():
        for images, labels in DataLoader(test_set, batch_size=128):
            correct += (model(images).argmax(1) == labels).sum().item()
    model.train()
    return correct / len(test_set)


def main() -> None:
    args = build_parser().parse_args()
    replica = int(os.environ["REPLICA_GROUP_ID"])
    replicas = int(os.environ["NUM_REPLICA_GROUPS"])
    timeout = timedelta(seconds=args.timeout)
    model = optimizer = None  # built below; the Manager reads them only in a quorum
    # the replica group's own store (a group of one rank), where the others reach it
    store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       optimizer.load_state_dict(state["optimizer"])),
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        use_async_quorum=False, init_sync=False, replica_id=f"replica{replica}",
        store_addr=socket.gethostname(), store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], timeout=timeout,
        quorum_timeout=timeout, connect_timeout=timeout)
    # after the Manager, which starts beating at once: the lighthouse's first quorum then
    # waits for every replica started together (it waits for those that beat)
    split = data.load(args.dataset, args.data_dir, args.train_samples, args.test_samples)
    seed_everything(args.seed)  # every replica the same initial weights: no step-0 heal
    model = build_model(args.arch, split.channels, split.num_classes, split.image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    ddp = SurvivingDDP(manager, model)
    wrapped = OptimizerWrapper(manager, optimizer)
    sampler = DistributedSampler(split.train, replica_rank=replica, num_replica_groups=replicas,
                                 group_rank=0, num_replicas=1, shuffle=True, seed=args.seed,
                                 drop_last=True)
    steps_per_epoch = len(sampler) // args.batch_size
    total = steps_per_epoch * args.epochs
    started, epoch_started = time.perf_counter(), time.perf_counter()
    participants, failing, losses = None, False, []
    while True:
        wrapped.zero_grad()  # the quorum; a replica behind the others heals here
        step = manager.current_step()
        if step >= total:
            break
        if manager.num_participants() != participants:
            participants = manager.num_participants()
            say(f"step {step}: a quorum of {participants} replica(s)")
        epoch, index = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        batch = list(sampler)[index * args.batch_size:(index + 1) * args.batch_size]
        images, labels = default_collate([split.train[i] for i in batch])
        for group in optimizer.param_groups:
            factor = cosine_decay(step / total) if args.schedule == "cosine" else 1.0
            group["lr"] = args.lr * factor
        loss = F.cross_entropy(ddp(images), labels)
        loss.backward()
        wrapped.step()  # steps only where every replica's step succeeded
        if manager.current_step() == step:
            failing = True
            say(f"step {step}: not committed ({str(manager.errored()).splitlines()[0][:160]})")
            continue
        if failing:
            failing = False
            say(f"step {step}: committed by {participants} replica(s)")
        losses.append(loss.item())
        if (step + 1) % steps_per_epoch == 0 and manager.participating_rank() == 0:
            accuracy = evaluate(model, split.test)
            seconds = time.perf_counter() - epoch_started
            say(f"epoch {epoch + 1}/{args.epochs}: train loss {sum(losses) / len(losses):.4f} "
                f"(this replica's)  test acc {accuracy:.2%}  {participants} replica(s)  "
                f"({seconds:.1f} s)")
            if args.metrics:
                with open(args.metrics, "a") as metrics:
                    metrics.write(json.dumps({
                        "epoch": epoch + 1, "test_acc": accuracy, "step": step + 1,
                        "replicas": participants, "seconds": seconds,
                        "images_committed": manager.batches_committed() * args.batch_size,
                    }) + "\n")
        if (step + 1) % steps_per_epoch == 0:
            epoch_started, losses = time.perf_counter(), []
    if manager.participating_rank() == 0:
        say(f"done in {time.perf_counter() - started:.1f} s")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
