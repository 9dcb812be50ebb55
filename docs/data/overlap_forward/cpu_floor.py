"""Where the two cores bound a trainer.bench run: four ranks share two cores, so a step
can take no less than twice the CPU one rank spends on it (cpu_ms: every thread of the
process, the kernel's work for its sockets included). For each run's rows, each
variant's step over that floor (1.00: the cores never idle), and what overlap=forward's
images/s over DDP's would be at DDP's own CPU (DDP's step over its floor): the most a
schedule can gain without spending less CPU than DDP.
    python docs/data/overlap_forward/cpu_floor.py RUN.jsonl [RUN.jsonl ...]"""
import json
import sys

AHEAD = "allreduce:overlap=forward"


def main(paths):
    print(f"{'run':48} {'allreduce':>9} {'forward':>8} {'ddp':>6} "
          f"{'forward/ddp':>11} {'at ddp cpu':>10} {'cpu ms forward-ddp':>18}")
    for path in paths:
        with open(path) as lines:
            rows = {row["sync"]: row for row in map(json.loads, lines)}
        floor = {sync: row["step_ms"] / (2 * row["cpu_ms"]) for sync, row in rows.items()}
        ahead, ddp = rows[AHEAD], rows["ddp"]
        print(f"{path:48} {floor['allreduce']:>9.3f} {floor[AHEAD]:>8.3f} {floor['ddp']:>6.3f} "
              f"{ddp['step_ms'] / ahead['step_ms']:>11.3f} {floor['ddp']:>10.3f} "
              f"{ahead['cpu_ms'] - ddp['cpu_ms']:>+18.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
