"""The tables of docs/benchmarks.md from run.sh's output: for each size (a row) and
world (a column), the time of what the tuning table chose and of what the cost model
chose, each over the quickest fixed algorithm's (collectives.bench's "# at" lines);
over 1.10 in bold.

    python docs/data/auto_in_turns/summary.py docs/data/auto_in_turns/{gloo,mpi}_?.txt
"""
import re
import sys

LINE = re.compile(r".*?# at\s+(\d+) B quickest\s+(\S+)\s+([\d.]+) us; chosen / quickest: (.*)")
CHOICE = re.compile(r"(table|model) (\S+) ([\d.]+)")
SHORT = {"ring": "ring", "halving-doubling": "hd", "tree": "tree", "naive": "naive",
         "native": "native", "hierarchical": "hier"}


def size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def cells(path: str) -> dict:
    """size -> 'table: algorithm ratio / model: algorithm ratio' of one run."""
    found = {}
    for line in open(path):
        match = LINE.match(line.strip())
        if match:
            nbytes, _, _, rest = match.groups()
            said = []
            for source, name, ratio in CHOICE.findall(rest):
                text = f"{SHORT.get(name, name)} {float(ratio):.2f}"
                said.append(f"**{text}**" if float(ratio) > 1.10 else text)
            found[int(nbytes)] = " / ".join(said)
    return found


def main(paths) -> None:
    runs = {path.rsplit("/", 1)[-1].removesuffix(".txt"): cells(path) for path in paths
            if not path.endswith("_tune.txt")}
    sizes = sorted({nbytes for run in runs.values() for nbytes in run})
    print("| size | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for nbytes in sizes:
        print(f"| {size(nbytes)} | " + " | ".join(run.get(nbytes, "-") for run in runs.values())
              + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
