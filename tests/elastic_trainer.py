"""A small elastic training loop for tests/test_elastic.py: a linear model on
generated data, all-reduced gradients, State and run from collectives.elastic.

    python elastic_trainer.py STORE NAME OUT [--die-at STEP] [--expected N] [--epochs E]
                              [--join-after FILE]

STORE: the store's port on this host, or HOST:PORT, or "env" ($COLLECTIVES_ELASTIC_STORE,
as the emulated cluster's --elastic-store gives it). NAME: the member's id ("-": the
default, host/pid). Writes OUT (torch.save; "{host}" in it becomes the host's name):
the final parameters, the steps and the generations seen; OUT.started once it trains,
OUT.epochE once it has trained epoch E. --join-after FILE: a newcomer that has started
(its imports take seconds) waits for FILE (another member's OUT.epochE, say) before it
joins, so that it comes at a known point of the training.
"""
import argparse
import os
import socket
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import collectives
from collectives.elastic.sampler import ElasticSampler
from collectives.elastic.membership import MembershipError
from collectives.elastic.state import State, run
from collectives.elastic.generations import ElasticWorld

BATCH = 8


def data():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(480, 16, generator=generator, dtype=torch.float64)
    targets = inputs @ torch.randn(16, 1, generator=generator, dtype=torch.float64)
    return TensorDataset(inputs, targets)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--die-at", type=int)
    p.add_argument("--expected", type=int)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--min-ranks", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--join-after")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = State(model, optimizer, epoch=1, done=0, steps=0)
    store = os.environ["COLLECTIVES_ELASTIC_STORE"] if args.store == "env" else args.store
    host, _, port = store.rpartition(":")
    args.out = args.out.replace("{host}", socket.gethostname())
    while args.join_after and not os.path.exists(args.join_after):
        time.sleep(0.05)  # the test that started us ends us if it never comes
    world = ElasticWorld(host or "127.0.0.1", int(port), min_ranks=args.min_ranks,
                         timeout=args.timeout, member_id=None if args.name == "-" else args.name,
                         settle=0.5, beat=0.1, dead_after=2.0)
    dataset = data()
    generations = []

    def train(state, world):
        comm = world.comm
        generations.append((world.view.generation, world.view.world_size))
        open(args.out + ".started", "w").close()  # a test may wait for this
        while state.epoch <= args.epochs:
            sampler = ElasticSampler(len(dataset), comm.rank, comm.world_size, BATCH,
                                     state.epoch, state.done)
            for inputs, targets in DataLoader(dataset, batch_size=BATCH, sampler=sampler):
                if args.die_at is not None and state.steps == args.die_at:
                    os._exit(9)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(inputs), targets).backward()
                grads = [p.grad for p in model.parameters()]
                collectives.all_reduce_coalesced(grads, op="avg", comm=comm)
                optimizer.step()
                time.sleep(args.step_seconds)
                state.done += BATCH * comm.world_size
                state.steps += 1
                state.commit()
            state.epoch, state.done = state.epoch + 1, 0
            open(f"{args.out}.epoch{state.epoch - 1}", "w").close()
            state.commit()

    started = time.monotonic()
    try:
        run(train, state, world, expected=args.expected)
    except MembershipError as error:
        print(f"elastic_trainer: error: {error}", file=sys.stderr)
        sys.exit(1)
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "steps": state.steps, "generations": generations,
                "seconds": time.monotonic() - started}, args.out)
    world.leave()


if __name__ == "__main__":
    main()
