"""CPU seconds of each thread of a process over a window, from /proc (every thread: the
Python ones and the C++ ones py-spy cannot see, gloo's among them).

    python docs/data/cpu/thread_cpu.py PID SECONDS > out.json
"""
import json
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict:
    """{tid: (name, CPU seconds so far)}"""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                text = stat.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue  # ended meanwhile
        fields = text[text.rindex(")") + 2:].split()
        found[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK)  # utime + stime
    return found


def main() -> None:
    pid, seconds = int(sys.argv[1]), float(sys.argv[2])
    before = threads(pid)
    time.sleep(seconds)
    after = threads(pid)
    rows = [dict(tid=tid, name=name, cpu_s=cpu - before.get(tid, (name, 0.0))[1])
            for tid, (name, cpu) in after.items()]
    json.dump(dict(pid=pid, seconds=seconds, threads=rows), sys.stdout)


if __name__ == "__main__":
    main()
