"""The figures the docs quote from deterministic runs are the ones the programs print.

A deterministic run prints the same digits every time on a CPU of one kind, and other
digits on another: torch picks its kernels by the instructions the CPU has
(docs/trainer.md, "Measured runs"). So a doc names the CPU its figures come from, as
"(CPU: MODEL, CAPABILITY)", MODEL as /proc/cpuinfo names it and CAPABILITY as
torch.backends.cpu.get_cpu_capability() does, and a run is compared with the figures
only on a CPU of that kind; on another it is skipped, saying which kind it found.

    the main job's first epoch (docs/trainer.md, README.md)   trained here, when asked
                                                              (COLLECTIVES_TRAIN_DOCS=1)
    the faces' losses (docs/faces.md)                          quoted_face_losses()
    the tutorial's byte counts (writing_a_sync_strategy.md)    quoted_tutorial_bytes()

The last two are read by the tests that run those programs anyway (test_faces.py,
test_tutorial.py), rather than running them again. A change that moves a figure fails
a test until the doc says the new one.
"""
import os
import re
from typing import Dict, Optional, Tuple

import pytest
import torch

from launchers import ROOT, TESTS, mpirun, run, trainer

DOCS = os.path.join(ROOT, "docs")


def read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as text:
        return text.read()


def this_cpu() -> str:
    """This machine's kind of CPU as the docs name it: 'AMD EPYC, AVX2'."""
    model = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), model)
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


def named_cpu(text: str) -> Optional[str]:
    """The CPU a passage names for its figures: '(CPU: AMD EPYC, AVX2)' -> 'AMD EPYC, AVX2'."""
    found = re.search(r"\(CPU: ([^)]+)\)", text)
    return found and found.group(1)


def section(text: str, heading: str) -> str:
    """A markdown section: from `heading` to the next heading of its level or above."""
    start = text.index(heading)
    level = heading.split(" ")[0]
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.MULTILINE).search(text, start + len(heading))
    return text[start:end.start() if end else len(text)]


def first_epoch(text: str) -> Tuple[str, str]:
    """(train loss, test acc) of the first 'epoch 1/3:' line of `text`, as printed."""
    found = re.search(r"epoch 1/3: train loss (\d+\.\d+)\s+test acc (\d+\.\d+)%", text)
    assert found, "no 'epoch 1/3: train loss ... test acc ...%' line"
    return found.group(1), found.group(2)


def quoted_main_job() -> Tuple[str, Tuple[str, str]]:
    """docs/trainer.md's main job: the CPU it ran on, and its first epoch's figures."""
    measured = section(read("docs", "trainer.md"), "## Measured runs")
    return named_cpu(measured), first_epoch(measured)


def quoted_face_losses() -> Tuple[str, Dict[int, str]]:
    """docs/faces.md's losses of examples/torch_ddp_script.py: the CPU, and rank -> loss."""
    text = read("docs", "faces.md")
    found = re.search(r"\(CPU: [^)]+\): both print the same losses \(rank 0 (\d\.\d{4}), "
                      r"rank 1\s+(\d\.\d{4})\)", text)
    assert found, "docs/faces.md no longer quotes the script's losses where it did"
    return named_cpu(found.group(0)), {0: found.group(1), 1: found.group(2)}


def printed_face_losses(stdout: str) -> Dict[int, str]:
    """What examples/torch_ddp_script.py printed: rank -> its loss."""
    return {int(rank): loss for rank, loss in
            re.findall(r"^rank (\d+) epoch 0 loss (\d+\.\d+)$", stdout, re.MULTILINE)}


def check_face_losses(stdout: str) -> None:
    """For the run of examples/torch_ddp_script.py (a test that runs it passes its
    stdout): the losses it printed are the ones docs/faces.md quotes, on that CPU."""
    cpu, quoted = quoted_face_losses()
    if cpu == this_cpu():
        assert printed_face_losses(stdout) == quoted, (
            f"the script printed {printed_face_losses(stdout)}, docs/faces.md quotes "
            f"{quoted} (CPU: {cpu}): update the doc with the change that moved them")


def quoted_tutorial_bytes() -> Tuple[int, int]:
    """The bytes a step sends in docs/writing_a_sync_strategy.md: (sign, allreduce)."""
    found = re.search(r'`bytes_per_step\(comm, "sign"\)` is ([\d,]+) bytes and\s+'
                      r'`bytes_per_step\(comm, "allreduce"\)` is ([\d,]+)',
                      read("docs", "writing_a_sync_strategy.md"))
    assert found, "the tutorial no longer quotes its byte counts where it did"
    return int(found.group(1).replace(",", "")), int(found.group(2).replace(",", ""))


def test_every_quoted_run_names_its_cpu_and_its_figures_can_be_read():
    cpu, figures = quoted_main_job()
    assert cpu, "docs/trainer.md's measured runs name no CPU: '(CPU: MODEL, CAPABILITY)'"
    assert quoted_face_losses()[0]
    sign, dense = quoted_tutorial_bytes()
    assert 4 * (sign - 4) == dense  # a quarter of the bytes, and one float32 scale
    # The README quotes a run of another CPU, and says what trainer.md's prints.
    readme = section(read("README.md"), "## The main job")
    found = re.search(r"\(CPU: ([^)]+)\) the first epoch\s+prints train loss (\d+\.\d+), "
                      r"test acc (\d+\.\d+)%", readme)
    assert found, "README.md does not say which CPU prints what trainer.md quotes"
    assert (found.group(1), (found.group(2), found.group(3))) == (cpu, figures)


def test_cluster_md_says_what_the_cluster_tests_check():
    with open(os.path.join(TESTS, "test_cluster.py")) as source:
        assert 'assert {r["transport"] for r in results} == {"gloo+shm"}' in source.read()
    assert "check `comm.name` is `gloo+shm` on 2 hosts x 2 ranks" in " ".join(
        read("docs", "cluster.md").split())


@pytest.mark.timeout(480)
@pytest.mark.skipif(not os.environ.get("COLLECTIVES_TRAIN_DOCS"),
                    reason="COLLECTIVES_TRAIN_DOCS=1 trains the main job's first epoch "
                           "(a minute alone, two beside the suite: more than CI's budget)")
def test_the_main_jobs_first_epoch_prints_what_the_docs_quote(tmp_path):
    """`mpirun -np 4 python -m trainer`, ended after its first epoch (--stop-at: the
    schedule still spans the 3 epochs, so the epoch is the full job's). Run with
    COLLECTIVES_TRAIN_DOCS=1 whenever a change may move the main job's numbers."""
    cpu, quoted = quoted_main_job()
    if cpu != this_cpu():
        pytest.skip(f"docs/trainer.md quotes a CPU of another kind ({cpu}; this: "
                    f"{this_cpu()})")
    out = run(mpirun(4, *trainer("--stop-at", "0.01", "--progress", "off")), tmp_path,
              timeout=450)
    assert first_epoch(out.stdout) == quoted, (
        f"the main job printed {first_epoch(out.stdout)}, docs/trainer.md quotes {quoted} "
        f"(CPU: {cpu}): update the docs with the change that moved them")
