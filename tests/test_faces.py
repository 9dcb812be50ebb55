"""The faces hold up: a torch DDP script with one import changed, DDP's join() and
torch's constructor arguments, Horovod's API with Horovod's semantics, and ranks that
use different parameters (gloo on 2 and 3 spawned ranks; mpi under mpirun)."""
import ast
import os
import subprocess
import sys

import pytest
import torch

import checks_faces as checks
from collectives.launch.mpirun import find_mpirun
from collectives.launch.spawn import free_port
from distributed import run_world, run_world_collecting_errors

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def same_everywhere(results):
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    return results[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_horovod_face_has_horovods_semantics(world_size):
    """Every collective and its forms; join() with zeros from the joined and the last
    rank's number, alone and under DistributedOptimizer on uneven inputs; ranks that
    use different parameters (once a 300 s hang); the optimizer's rules."""
    results = same_everywhere([r[1:] for r in run_world(checks.check_horovod_face,
                                                        world_size, timeout=220)])
    assert results[0] == results[2] == world_size - 1  # join() named the last rank


@pytest.mark.timeout(300)
def test_both_faces_on_the_mpi_backend():
    """The Horovod checks and our DDP's join() under mpirun; join ends where it ends on
    gloo, bit for bit."""
    on_gloo = same_everywhere(run_world(checks.ddp_join_digest, 3, timeout=100))
    out = subprocess.run([find_mpirun()[0], "-np", "3", sys.executable, "checks_faces.py"],
                         cwd=HERE, capture_output=True, text=True, timeout=220,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.split("results ")[1] for line in out.stdout.splitlines() if "results" in line]
    assert len(lines) == 3 and len(set(lines)) == 1, out.stdout
    assert ast.literal_eval(lines[0])[-1] == on_gloo, (lines[0], on_gloo)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_join_with_uneven_inputs_equals_torch_ddp(world_size):
    same_everywhere(run_world(checks.check_ddp_join_both_ways, world_size, timeout=180))


@pytest.mark.timeout(120)
def test_ddp_join_can_throw_on_every_rank():
    for status, message in run_world_collecting_errors(checks.check_ddp_join_throws_early, 3):
        assert status == "raised" and "ran out of inputs" in message, message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_ranks_using_different_parameters_fail_clearly_not_hang(world_size):
    outcomes = run_world_collecting_errors(checks.check_ddp_uneven_parameters_without_flag,
                                           world_size, timeout=100)
    # every rank but 0 lacks head_a's gradients (and rank 0 head_b's): each raises,
    # naming them, after taking part in the round, so nobody waits for anybody
    for status, message in outcomes:
        assert status == "raised" and "find_unused_parameters=True" in message, message


@pytest.mark.timeout(120)
def test_ddp_on_a_torch_subgroup_and_with_torch_ddp_arguments():
    assert run_world(checks.check_ddp_subgroup_and_arguments, 3, timeout=100) == [
        (2, True), (2, True), (None, True)]


@pytest.mark.timeout(300)
def test_torch_ddp_script_with_one_import_changed(tmp_path):
    """examples/torch_ddp_script.py under torchrun: the script makes its own process
    group; ours ends with torch DDP's parameters."""
    saved = {}
    for face in ("torch", "collectives"):
        path = tmp_path / f"{face}.pt"
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                              "--nproc-per-node", "2", "--master-port", str(free_port()),
                              os.path.join(ROOT, "examples", "torch_ddp_script.py"),
                              "--face", face, "--save", str(path)],
                             capture_output=True, text=True, timeout=240,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stdout + out.stderr
        saved[face] = torch.load(path)
    for name, expected in saved["torch"].items():
        torch.testing.assert_close(saved["collectives"][name], expected, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(120)
def test_horovod_backward_passes_per_step_with_a_parameter_used_in_fewer_passes():
    """backward_passes_per_step=2 and a parameter whose hook fires once in a step on one
    rank: its accumulated gradient is averaged (not zeros), and the next step's count
    starts afresh (no bucket launched after one pass)."""
    same_everywhere(run_world(checks.check_horovod_backward_passes_per_step, 2, timeout=100))


@pytest.mark.timeout(120)
def test_horovod_more_backward_passes_than_per_step_fail_clearly():
    for message in run_world(checks.check_horovod_too_many_backward_passes, 2, timeout=100):
        assert "more backward passes" in message, message
