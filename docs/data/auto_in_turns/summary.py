"""The tables of docs/benchmarks.md from run.sh's output: for each size (a row) and
world (a column), the time of what the tuning table chose and of what the cost model
chose, each over the quickest fixed algorithm's (collectives.bench's "# at" lines);
over 1.10 in bold.

    python docs/data/auto_in_turns/summary.py docs/data/auto_in_turns/{gloo,mpi}_?.txt

Given runs of the same worlds from several folders (run.sh with OUT=folder), a cell
is the median ratio over the runs, with the algorithms chosen in them:

    python docs/data/auto_in_turns/summary.py docs/data/auto_in_turns/{,run2/,run3/}{gloo,mpi}_?.txt

and a last line says how far apart two rows of the same algorithm came out (auto's own
row over the row of the algorithm it chose, same run): what a ratio can resolve.
"""
import re
import sys
from collections import defaultdict

LINE = re.compile(r".*?# at\s+(\d+) B quickest\s+(\S+)\s+([\d.]+) us; chosen / quickest: (.*)")
CHOICE = re.compile(r"(table|model) (\S+) ([\d.]+)")
OWN_ROW = re.compile(r"auto's own row ([\d.]+)")
SHORT = {"ring": "ring", "halving-doubling": "hd", "tree": "tree", "naive": "naive",
         "native": "native", "hierarchical": "hier"}


def size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def read(path: str):
    """size -> [(source, algorithm, ratio)], and auto's own row over its choice's."""
    found, own = {}, []
    for line in open(path):
        match = LINE.match(line.strip())
        if match:
            nbytes, _, _, rest = match.groups()
            choices = [(source, name, float(ratio))
                       for source, name, ratio in CHOICE.findall(rest)]
            found[int(nbytes)] = choices
            row = OWN_ROW.search(rest)
            if row and choices:  # auto follows its first source (the table, if any)
                own.append(float(row.group(1)) / choices[0][2])
    return found, own


def median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def cell(runs) -> str:
    """One world at one size over its runs: per source, the median ratio and choices."""
    by_source = defaultdict(list)
    for choices in runs:
        for source, name, ratio in choices:
            by_source[source].append((name, ratio))
    said = []
    for source, picks in by_source.items():
        names = ",".join(dict.fromkeys(SHORT.get(name, name) for name, _ in picks))
        ratio = median([ratio for _, ratio in picks])
        text = f"{names} {ratio:.2f}"
        said.append(f"**{text}**" if ratio > 1.10 else text)
    return " / ".join(said)


def main(paths) -> None:
    worlds = defaultdict(list)  # world name -> one {size: choices} per run
    own = []
    for path in paths:
        if path.endswith("_tune.txt"):
            continue
        found, rows = read(path)
        worlds[path.rsplit("/", 1)[-1].removesuffix(".txt")].append(found)
        own += rows
    sizes = sorted({nbytes for runs in worlds.values() for run in runs for nbytes in run})
    print("| size | " + " | ".join(worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for nbytes in sizes:
        print(f"| {size(nbytes)} | " + " | ".join(
            cell([run[nbytes] for run in runs if nbytes in run]) or "-"
            for runs in worlds.values()) + " |")
    if own:
        own.sort()
        print(f"\nauto's own row over its choice's, {len(own)} cells: {own[0]:.2f} to "
              f"{own[-1]:.2f}, median {median(own):.2f}, "
              f"{sum(1 for r in own if r > 1.10 or r < 1 / 1.10)} beyond 1.10 either way")


if __name__ == "__main__":
    main(sys.argv[1:])
