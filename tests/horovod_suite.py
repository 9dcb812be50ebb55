"""Run Horovod's own PyTorch test file against `collectives.horovod`, as Horovod runs it.

    python tests/horovod_suite.py PATH/TO/horovod/test/parallel/test_torch.py [--np 2]

The file is Horovod's (not part of this repository: take it from a Horovod checkout).
This script puts it in a scratch folder beside two small stand-ins:

    horovod/torch/__init__.py   `from collectives.horovod import *`, so the file's
                                `import horovod.torch as hvd` gets our face
    common.py                   the three helpers the file imports from Horovod's test
                                utilities (mpi_env_rank_and_size, skip_or_fail_gpu_test,
                                temppath), written here from their documented behaviour
    conftest.py                 only when asked: --py311-compat aliases
                                inspect.getargspec (removed in Python 3.11; three of
                                the file's tests call it) to inspect.getfullargspec;
                                --without-optimizer NAME hides a torch optimizer from
                                the file's loops over every torch.optim class (torch
                                2.14's Muon takes only 2-D parameters, so it cannot
                                optimize the file's models)

and runs one pytest process per rank for the whole file under mpirun, as Horovod's CI
does. Each rank writes a JUnit report; the summary counts every test by its outcome on
all ranks (a test passes when it passes on every rank) and names the failures. A job
that outlives --timeout is killed and reported as hung, with the test it was in.

--each runs one job per test instead (pytest's node id, `FILE::CLASS::test_x`), each
under its own --timeout: no test can then be harmed by the one before it.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import defaultdict

from collectives.launch.mpirun import mpirun_command

SHIM = "from collectives.horovod import *  # noqa: F401,F403\n"

COMMON = '''"""Stand-ins for the helpers Horovod's test files import from test/utils/common.py."""
import contextlib
import os
import shutil
import tempfile


def mpi_env_rank_and_size():
    """Rank and size from the MPI launcher's variables; (0, 1) outside MPI."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    """Fail when HOROVOD_TEST_GPU=1 asks for GPU tests, else skip."""
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    else:
        test.skipTest(message)


@contextlib.contextmanager
def temppath():
    """A fresh path (nothing created there), removed afterwards if something was."""
    path = tempfile.mktemp()
    try:
        yield path
    finally:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
'''

RUN_RANK = ("import os, sys, pytest; "
            "rank = os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '0')); "
            "sys.exit(pytest.main(['-v', '-p', 'no:cacheprovider', '-o', 'addopts=', "
            "'--junitxml=rank%s.xml' % rank] + sys.argv[1:]))")


COMPAT = '''"""Python 3.11 removed inspect.getargspec; the test file still calls it."""
import inspect

if not hasattr(inspect, "getargspec"):
    inspect.getargspec = inspect.getfullargspec
'''

HIDE_OPTIMIZER = '''
import torch.optim  # the file keeps optimizers whose module starts with "torch.optim"
getattr(torch.optim, {name!r}).__module__ = "hidden-by-horovod-suite"
'''


def prepare(test_file: str, folder: str, compat: bool, hidden: list) -> str:
    package = os.path.join(folder, "horovod", "torch")
    os.makedirs(package)
    open(os.path.join(folder, "horovod", "__init__.py"), "w").close()
    with open(os.path.join(package, "__init__.py"), "w") as out:
        out.write(SHIM)
    with open(os.path.join(folder, "common.py"), "w") as out:
        out.write(COMMON)
    with open(os.path.join(folder, "conftest.py"), "w") as out:
        out.write(COMPAT if compat else "")
        for name in hidden:
            out.write(HIDE_OPTIMIZER.format(name=name))
    target = os.path.join(folder, os.path.basename(test_file))
    shutil.copy(test_file, target)
    return target


def outcomes(folder: str, ranks: int) -> dict:
    """test name -> {rank: outcome}, from each rank's JUnit report."""
    table = defaultdict(dict)
    for rank in range(ranks):
        path = os.path.join(folder, f"rank{rank}.xml")
        if not os.path.exists(path):
            continue
        for case in ElementTree.parse(path).iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                elif child.tag == "skipped":
                    outcome = "skipped"
            table[case.get("name")][rank] = outcome
    return table


def last_test_started(log: str) -> str:
    started = [line.split("::")[-1].split()[0] for line in log.splitlines()
               if "::" in line and ("PASSED" not in line and "FAILED" not in line
                                    and "SKIPPED" not in line and "ERROR" not in line)]
    return started[-1] if started else "?"


def test_ids(target: str) -> list:
    """pytest's node id of every test method in the file, in the file's order."""
    with open(target) as source:
        text = source.read()
    ids, current = [], None
    for line in text.splitlines():
        found_class = re.match(r"class (\w+)\(", line)
        if found_class:
            current = found_class.group(1)
        found_test = re.match(r"    def (test_\w+)\(self", line)
        if found_test and current:
            ids.append(f"{os.path.basename(target)}::{current}::{found_test.group(1)}")
    return ids


def run_job(folder: str, selection: str, args) -> tuple:
    """One mpirun of one pytest per rank over `selection` (the file, or a node id):
    every test's outcome per rank, and the test it hung in (None if it did not)."""
    for rank in range(args.np):  # a report left by an earlier job must not count
        if os.path.exists(os.path.join(folder, f"rank{rank}.xml")):
            os.remove(os.path.join(folder, f"rank{rank}.xml"))
    command, environment = mpirun_command(
        args.np, [sys.executable, "-c", RUN_RANK, selection]
        + (["-k", args.select] if args.select else []))
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [folder,
                                                              environment.get("PYTHONPATH")]))
    hung = None
    # In a session of its own, so that a job past its time ends whole: mpirun and ranks.
    job = subprocess.Popen(command, cwd=folder, env=environment, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = job.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        log, _ = job.communicate()
        hung = last_test_started(log) if "::" not in selection else selection
    with open(os.path.join(folder, "job.log"), "a") as out:
        out.write(log)
    return outcomes(folder, args.np), hung


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", help="Horovod's test/parallel/test_torch.py")
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds before the job counts as hung (default 1200)")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--py311-compat", action="store_true",
                        help="alias inspect.getargspec for the file's older tests")
    parser.add_argument("--without-optimizer", action="append", default=[], metavar="NAME",
                        help="hide torch.optim.NAME from the file's optimizer loops")
    parser.add_argument("--each", action="store_true",
                        help="one job per test, each under --timeout")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="horovod-suite-")
    target = prepare(os.path.abspath(args.test_file), folder, args.py311_compat,
                     args.without_optimizer)
    print("running:", "mpirun -np", args.np, "python -m pytest", os.path.basename(target),
          "(one pytest per rank" + (", one job per test" if args.each else "") + ") in",
          folder, flush=True)
    if args.each:
        table, hung = defaultdict(dict), []
        for node in test_ids(target):
            outcome, hung_in = run_job(folder, node, args)
            for name, by_rank in outcome.items():
                table[name].update(by_rank)
            if hung_in:
                hung.append(node.split("::")[-1])
        hung = ", ".join(hung)
    else:
        table, hung = run_job(folder, os.path.basename(target), args)
    totals = defaultdict(list)
    for name, by_rank in sorted(table.items()):
        seen = set(by_rank.values())
        if len(by_rank) < args.np:
            verdict = "incomplete"
        elif "failed" in seen:
            verdict = "failed"
        elif seen == {"skipped"}:
            verdict = "skipped"
        else:
            verdict = "passed"
        totals[verdict].append(name)
    for verdict in ("failed", "incomplete"):
        for name in totals[verdict]:
            print(f"  {verdict}: {name}  {dict(sorted(table[name].items()))}")
    print(f"{len(table)} tests: " + ", ".join(f"{len(totals[v])} {v}" for v in
                                              ("passed", "failed", "skipped", "incomplete")))
    if hung:
        print(f"HUNG after {args.timeout:.0f} s{' (each)' if args.each else ''} in {hung}")
    print(f"log and reports: {folder}" if args.keep or totals["failed"] or hung
          else "", end="")
    if not (args.keep or totals["failed"] or hung):
        shutil.rmtree(folder, ignore_errors=True)
    print()
    return 1 if totals["failed"] or totals["incomplete"] or hung else 0


if __name__ == "__main__":
    sys.exit(main())
