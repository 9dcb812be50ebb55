"""What profile.sh measured: CPU per second of rank 1, by thread, and where the Python
threads spent it (top leaf frames of py-spy's samples).

    python docs/data/cpu/summarize.py allreduce ddp bf16 ddp-bf16
"""
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def python_threads(stacks_path: str) -> dict:
    """{tid: (thread name, Counter of leaf frames)} from py-spy's raw output."""
    found = {}
    with open(stacks_path) as stacks:
        for line in stacks:
            stack, count = line.rstrip("\n").rsplit(" ", 1)
            head, *frames = stack.split(";")
            match = re.match(r"thread \((\d+)\)(?:: (.*))?", head)
            if not match:
                continue
            tid, name = int(match.group(1)), match.group(2) or "?"
            if frames and frames[0] == name:  # py-spy repeats the name as a first frame
                frames = frames[1:]
            leaf = re.sub(r" \(.*", "", frames[-1]) if frames else "?"
            found.setdefault(tid, (name, collections.Counter()))[1][leaf] += int(count)
    return found


def main() -> None:
    for sync in sys.argv[1:]:
        with open(os.path.join(HERE, f"{sync}.json")) as source:
            measured = json.load(source)
        named = python_threads(os.path.join(HERE, f"{sync}.txt"))
        seconds, pid = measured["seconds"], measured["pid"]
        groups = collections.Counter()
        for thread in measured["threads"]:
            if thread["tid"] == pid:
                group = "training thread (Python)"
            elif thread["tid"] in named:
                group = f"{named[thread['tid']][0]} (Python)"
            else:
                group = f"{thread['name']} (C++)"
            groups[group] += thread["cpu_s"] / seconds
        total = sum(groups.values())
        print(f"## {sync}: rank 1 used {total:.2f} CPU seconds per second")
        for group, share in groups.most_common():
            if share >= 0.005:
                print(f"  {share:5.2f}  {group}")
        for tid, (name, leaves) in named.items():
            samples = sum(leaves.values())
            if samples < 50:
                continue
            print(f"  where {name} spent its samples ({samples}):")
            for leaf, count in leaves.most_common(8):
                print(f"    {count / samples:5.1%}  {leaf}")


if __name__ == "__main__":
    main()
