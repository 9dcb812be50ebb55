"""torch's own distributed test suite, run against a backend: ours or gloo to compare.

    python tests/torch_suite.py                          # "collectives", 2 ranks, all tests
    python tests/torch_suite.py --backend gloo           # the same suite on gloo
    python tests/torch_suite.py -k all_reduce -k barrier # only tests whose name has these
    python tests/torch_suite.py --report suite.json      # every test's outcome, for diffing

The suite ships inside torch's wheel: `torch/testing/_internal/distributed/
distributed_test.py`, about 285 tests in `DistributedTest._DistTestBase`, each run on
WORLD_SIZE processes that call `init_process_group(BACKEND)`. torch's repository runs it
through `test/distributed/test_distributed_spawn.py`; this file does the same job: it
sets the variables the suite reads, builds the test class, runs it and counts.

The suite gates tests on backend names (`DistTestCases.backend_feature`: which
backends do DDP, subgroups, ...). "collectives" offers what gloo offers on the CPU, so
it is added wherever gloo is. Many tests are kept for gloo by name alone
(`require_backend_is_available({"gloo"})`, `BACKEND == "gloo"`): `--as-gloo` registers
our backend under the name "gloo" for the run, so those run on ours too (and the
suite's gloo-specific expectations apply to it).

    python tests/torch_suite.py --as-gloo                # ours, every CPU test


Takes about half an hour on 2 cores; not part of the default test run. Needs
`expecttest` (in the test extra).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import unittest

AS_GLOO = "COLLECTIVES_SUITE_AS_GLOO"  # --as-gloo, seen by the spawned ranks too


def _arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="collectives", help="collectives or gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--report", help="write every test's outcome to this JSON file")
    parser.add_argument("--as-gloo", action="store_true",
                        help="register our backend under the name gloo, so the tests the "
                             "suite keeps for gloo by name run on ours too")
    return parser.parse_args()


def _prepare_environment(backend: str, world_size: int, as_gloo: bool) -> None:
    """What the suite reads at import: BACKEND, WORLD_SIZE, TEMP_DIR with a barrier."""
    if as_gloo:
        os.environ[AS_GLOO] = "1"
        backend = "gloo"
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world_size)
    if "TEMP_DIR" not in os.environ:
        os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch-suite-")
    open(os.path.join(os.environ["TEMP_DIR"], "barrier"), "a").close()
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _make_test_class():
    """The suite's test class for $BACKEND (done at import, so spawned ranks do it too).

    The suite reads its gates when it is imported, so they are set first."""
    import collectives.torch_backend
    from torch.testing._internal.common_distributed import DistTestCases
    backend = os.environ["BACKEND"]
    if backend == collectives.torch_backend.NAME:
        collectives.torch_backend.register()
        for backends in DistTestCases.backend_feature.values():
            if "gloo" in backends:
                backends.add(backend)
        DistTestCases.backend_feature["plugin"].add(backend)
    if os.environ.get(AS_GLOO):  # ours answers to the name "gloo"
        import functools
        import torch.distributed as dist
        as_gloo = functools.partial(collectives.torch_backend._create, name="gloo")
        dist.Backend.register_backend("gloo", as_gloo, extended_api=True, devices=["cpu"])
    from torch.testing._internal.distributed.distributed_test import (DistributedTest,
                                                                      TestDistBackend)

    class TestBackend(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    TestBackend.__name__ = TestBackend.__qualname__ = f"TestBackend_{backend}"
    return TestBackend


class _Counting(unittest.TextTestResult):
    """Keeps each test's outcome and a one-line reason."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self.started = {}

    def startTest(self, test):
        self.started[test.id()] = time.monotonic()
        super().startTest(test)

    def _note(self, test, outcome, reason=""):
        name = test.id().rsplit(".", 1)[-1]
        seconds = round(time.monotonic() - self.started.get(test.id(), time.monotonic()), 1)
        self.outcomes[name] = {"outcome": outcome, "reason": reason, "seconds": seconds}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "failed", _last_line(self._exc_info_to_string(err, test)))

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "failed", _last_line(self._exc_info_to_string(err, test)))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._note(test, "passed", "expected failure")


def _last_line(text: str) -> str:
    """The most telling line of a failure: the last one that names an error."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def main() -> int:
    args = _arguments()
    test_class = _test_class
    loader = unittest.TestLoader()
    names = [name for name in loader.getTestCaseNames(test_class)
             if not args.patterns or any(p in name for p in args.patterns)]
    suite = unittest.TestSuite(test_class(name) for name in names)
    print(f"{len(names)} tests of torch's distributed_test.py on backend "
          f"{os.environ['BACKEND']!r}, {os.environ['WORLD_SIZE']} ranks", flush=True)
    runner = unittest.TextTestRunner(resultclass=_Counting, verbosity=1, stream=sys.stderr)
    result = runner.run(suite)
    counts = {}
    for entry in result.outcomes.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    name = "collectives as gloo" if os.environ.get(AS_GLOO) else os.environ["BACKEND"]
    print(f"\n{name}: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in
                                                  ("passed", "failed", "skipped")))
    for name, entry in sorted(result.outcomes.items()):
        if entry["outcome"] == "failed":
            print(f"  FAILED {name}: {entry['reason']}")
    if args.report:
        with open(args.report, "w") as out:
            json.dump({"backend": name,
                       "world_size": int(os.environ["WORLD_SIZE"]),
                       "tests": result.outcomes}, out, indent=1, sort_keys=True)
    return 0 if not counts.get("failed") else 1


if __name__ == "__main__":
    _options = _arguments()
    _prepare_environment(_options.backend, _options.world_size, _options.as_gloo)
if "BACKEND" in os.environ:  # also in each spawned rank, which imports this file
    _test_class = _make_test_class()
    globals()[_test_class.__name__] = _test_class  # ranks find it by this name

if __name__ == "__main__":
    sys.exit(main())
