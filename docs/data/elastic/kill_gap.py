"""How long survivors stop when a member is SIGKILLed: docs/elastic.md's measurement.

    python docs/data/elastic/kill_gap.py          # prints, for each survivor, the seconds
                                                  # from the kill to its next step

Three members (this file run as `member`) on one host, the library's default membership
settings (beat 0.5 s, dead_after 5 s, settle 1 s), each step an all-reduce of 257 KiB
and 0.1 s of sleep standing for compute; member c dies (os._exit) at step 20.
"""
import os
import subprocess
import sys
import time

import torch

STEPS, DIES_AT = 60, 20


def member(port: int, name: str, die_at: int) -> None:
    import collectives
    from collectives.elastic import ElasticWorld, State, run
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.01), step=0)
    world = ElasticWorld("127.0.0.1", port, timeout=30, member_id=name)

    def train(state, world):
        comm = world.comm
        while state.step < STEPS:
            if state.step == die_at:
                print(f"{time.monotonic():.3f} dying", flush=True)
                os._exit(9)
            collectives.all_reduce_coalesced([torch.randn(256, 256), torch.randn(256)],
                                             op="avg", comm=comm)
            time.sleep(0.1)
            state.step += 1
            print(f"{time.monotonic():.3f} {state.step} {world.view.generation}", flush=True)
            state.commit()

    run(train, state, world, expected=3)
    world.leave()


def main() -> None:
    from collectives.elastic.store import serve
    store = serve(0)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    members = {name: subprocess.Popen(
        [sys.executable, __file__, "member", str(store.port), name,
         str(DIES_AT if name == "c" else -1)], stdout=subprocess.PIPE, text=True, env=env)
        for name in "abc"}
    out = {name: process.communicate(timeout=300)[0] for name, process in members.items()}
    died = float(next(line for line in out["c"].splitlines() if "dying" in line).split()[0])
    for name in "ab":
        steps = [line.split() for line in out[name].splitlines() if len(line.split()) == 3]
        resumed = min(float(t) for t, _, generation in steps if generation != "0")
        print(f"{name}: exit {members[name].returncode}, next step {resumed - died:.2f} s "
              f"after the kill, {steps[-1][1]} steps in all")


if __name__ == "__main__":
    if sys.argv[1:2] == ["member"]:
        member(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        main()
