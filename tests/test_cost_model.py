"""The cost model: each algorithm's cost() against the formula worked by hand, the fit
recovering known constants from noisy synthetic timings, auto's choice beyond what
was measured, and the command line end to end on 2 ranks."""
import json
import math
import os
import random

import pytest

from collectives import algorithms
from collectives.algorithms import COSTS, auto, fastest
from collectives.algorithms.costs import Constants, Route, Shape, wire_beta
from collectives.cost_model import calibrate as calibration
from collectives.cost_model.units import parse_latency, parse_rate
from collectives.transport.topology import Topology
from distributed import run_world
from launchers import as_launched, python, run

# Round numbers, so every case below can be checked with pencil and paper.
C = Constants(local=Route(1e-3, 1e-9), network=Route(1e-2, 1e-8), gamma=1e-10,
              overhead={"default": 1e-4}, native=Route(2e-3, 2e-9))

HAND_WORKED = [
    # ring, 4 ranks on one host, 4e6 bytes: 2 x 3 steps of one 1e6-byte chunk
    # (1e-3 + 1e-4 + 1e6 x 1e-9 = 2.1e-3 each) + 3/4 x 4e6 x 1e-10 reduced
    ("ring", 4e6, Shape(1, 4), 6 * 2.1e-3 + 3e-4),
    # the same on 2 hosts of 2: every step waits on the network message
    # (1e-2 + 1e-4 + 1e6 x 1e-8 = 2.01e-2)
    ("ring", 4e6, Shape(2, 2), 6 * 2.01e-2 + 3e-4),
    # tree, 8 ranks on a host, 1e6 bytes: 3 levels up (2.1e-3 + 1e-4 reduced) and
    # 3 levels down (2.1e-3)
    ("tree", 1e6, Shape(1, 8), 3 * 2.2e-3 + 3 * 2.1e-3),
    # tree on 2 x 2: one level inside each host, one across (2.01e-2)
    ("tree", 1e6, Shape(2, 2), (2.1e-3 + 1e-4) + (2.01e-2 + 1e-4) + 2.1e-3 + 2.01e-2),
    # halving-doubling, 4 ranks: distance 2 swaps 2e6 bytes each way twice (3.1e-3)
    # and reduces 2e6; distance 1 swaps 1e6 twice (2.1e-3) and reduces 1e6
    ("halving-doubling", 4e6, Shape(1, 4), 2 * 3.1e-3 + 2e-4 + 2 * 2.1e-3 + 1e-4),
    # hierarchical 2 x 2, 1e6 bytes (one chunk): its own 1e-4 once, reduce-scatter
    # inside (1e-3 + 1e-4 + 5e5 x 1e-9, + 5e5 x 1e-10 reduced), two rings of 5e5 bytes
    # sharing each link (1e-2 + 1e-4 + 2.5e5 x 2e-8 per step, + 2.5e5 x 1e-10 reduced),
    # all-gather inside
    ("hierarchical", 1e6, Shape(2, 2),
     1e-4 + (1.6e-3 + 5e-5) + (2 * 1.51e-2 + 2.5e-5) + 1.6e-3),
    # naive on 3 hosts of 1: rank 0 receives twice (2.01e-2 + 1e-4 reduced each), then
    # sends to both at once: its link carries 2e6 bytes (1e-2 + 2e-2), 2 overheads
    ("naive", 1e6, Shape(3, 1), 2 * (2.01e-2 + 1e-4) + (2 * 1e-4 + 3e-2)),
    # the backend's own, 2 ranks on a host: its own route, one message per step:
    # (2e-3 + 1e-4 + 1e6 x 2e-9) twice + 1e6 x 1e-10 reduced
    ("native", 2e6, Shape(1, 2), 2 * 4.1e-3 + 1e-4),
]


@pytest.mark.parametrize("algorithm,nbytes,shape,seconds", HAND_WORKED,
                         ids=[f"{a}-{s.hosts}x{s.ranks_per_host}" for a, _, s, _ in HAND_WORKED])
def test_cost_matches_the_formula_worked_by_hand(algorithm, nbytes, shape, seconds):
    assert COSTS["all_reduce"][algorithm](nbytes, shape, C) == pytest.approx(seconds, rel=1e-9)


def test_other_collectives_costs():
    # pairwise all-to-all, 3 ranks, 1e6 bytes per piece: 2 steps of 2.1e-3
    assert COSTS["all_to_all"]["pairwise"](1e6, Shape(1, 3), C) == pytest.approx(4.2e-3)
    # tree broadcast, 4 ranks on 2 hosts: across (2.01e-2), then inside (2.1e-3)
    assert COSTS["broadcast"]["tree"](1e6, Shape(2, 2), C) == pytest.approx(2.22e-2)
    # ring reduce-scatter plus all-gather is the ring all-reduce
    rs = COSTS["reduce_scatter"]["ring"](4e6, Shape(1, 4), C)
    ag = COSTS["all_gather"]["ring"](4e6, Shape(1, 4), C)
    assert rs + ag == pytest.approx(COSTS["all_reduce"]["ring"](4e6, Shape(1, 4), C))


def test_through_shared_memory_the_rings_relays_move_nothing_of_their_own():
    shm = Constants(**{**C.__dict__, "transport": "gloo+shm"})
    # 4 ranks, 4e6 bytes: of the 3 reduce-scatter steps, steps 1 and 2 (n - 2) send the
    # sum the step before wrote straight into their outgoing slot: 2 x 1e6 x 1e-9 less
    ring = COSTS["all_reduce"]["ring"]
    assert ring(4e6, Shape(1, 4), shm) == pytest.approx(6 * 2.1e-3 + 3e-4 - 2e-3)
    assert ring(4e6, Shape(1, 2), shm) == ring(4e6, Shape(1, 2), C)  # no step between
    assert ring(4e6, Shape(2, 2), shm) == ring(4e6, Shape(2, 2), C)  # relays cross hosts
    # the job's transport decides: the same constants for a job on plain gloo
    assert ring(4e6, Shape(1, 4), shm.for_job(transport="gloo")) == ring(4e6, Shape(1, 4), C)
    assert shm.for_job().transport == "gloo+shm"
    # the backend's own all-reduce does not go through our shared memory
    native = COSTS["all_reduce"]["native"]
    assert native(4e6, Shape(1, 4), shm) == native(4e6, Shape(1, 4), C)


def test_segments_add_a_message_each():
    one = COSTS["all_reduce"]["ring"](4 * 2**22, Shape(1, 4), C)  # chunks of one segment
    two = COSTS["all_reduce"]["ring"](8 * 2**22, Shape(1, 4), C)  # two segments a chunk
    # twice the bytes: twice the byte terms, and 6 more messages (one per step)
    bytes_part = one - 6 * 1.1e-3
    assert two == pytest.approx(2 * bytes_part + 12 * 1.1e-3)


def test_overheads_per_algorithm():
    mine = Constants(**{**C.__dict__, "overhead": {"default": 1e-4, "tree": 0.0,
                                                   "ring@network": 5e-4}})
    assert COSTS["all_reduce"]["tree"](1e6, Shape(1, 8), mine) == pytest.approx(
        3 * 2.1e-3 + 3 * 2.0e-3)
    assert mine.per_message("ring") == 1e-4
    assert mine.per_message("ring", network=True) == 5e-4
    assert mine.per_message("tree", network=True) == 0.0
    assert mine.per_message("naive", network=True) == 1e-4


def test_another_link_keeps_the_hosts_share():
    host_share = 1e-9
    measured = Constants(**{**C.__dict__, "network": Route(1e-4, wire_beta(12.5e6) + host_share),
                            "link_rate": 12.5e6})
    faster = measured.with_link(parse_rate("1gbit"), parse_latency("2ms"))
    assert faster.network.beta == pytest.approx(host_share + 8 / 1e9 / (1448 / 1514))
    assert faster.network.alpha == pytest.approx(1e-4 + 2e-3)
    assert faster.link_rate == 125e6
    assert measured.with_link().network == measured.network


def test_fastest_is_the_argmin():
    shape = Shape(2, 2)
    times = {name: cost(64e6, shape, C) for name, cost in COSTS["all_reduce"].items()}
    assert fastest("all_reduce", 64e6, shape, C) == min(times, key=times.get) == "hierarchical"
    # small messages on one host: the fewest hops, not the fewest bytes
    assert fastest("all_reduce", 64, Shape(1, 8), C) != "ring"


def test_units():
    assert parse_rate("25gbit") == 25e9 / 8
    assert parse_rate("100Mbit") == 12.5e6
    assert parse_latency("10us") == pytest.approx(1e-5)
    with pytest.raises(Exception, match="bad rate"):
        parse_rate("fast")


# ---- the fit -----------------------------------------------------------------------------

TRUTH = Constants(local=Route(30e-6, 1 / 3e9), network=Route(200e-6, wire_beta(12.5e6)),
                  gamma=1 / 5e9, native=Route(400e-6, 1 / 1.5e9),
                  overhead={"default": 40e-6, "ring": 60e-6, "tree": 25e-6, "naive": 20e-6,
                            "halving-doubling": 50e-6, "hierarchical": 70e-6})


def synthetic_points(truth, noise, seed=0):
    """What calibrate's sweep would measure on 2 hosts of 2 ranks, timed with noise."""
    rng = random.Random(seed)
    sets = [("world", Shape(2, 2), calibration.WORLD_ALGORITHMS),
            ("host", Shape(1, 2), calibration.GROUP_ALGORITHMS),
            ("leaders", Shape(2, 1), calibration.GROUP_ALGORITHMS)]
    points = []
    for name, shape, names in sets:
        for algorithm in names:
            for nbytes in calibration.SIZES:
                exact = COSTS["all_reduce"][algorithm](nbytes, shape, truth)
                points.append(calibration.Point(algorithm, nbytes, shape.hosts,
                                                shape.ranks_per_host,
                                                exact * math.exp(rng.gauss(0, noise)), name))
    return points


def test_fit_recovers_known_constants_from_noisy_timings():
    points = synthetic_points(TRUTH, noise=0.03)
    fitted, measured = calibration.fit(points)
    # 2 x 2 touches every constant but the backend's own route inside a host (its ring
    # crosses hosts at every step, so the network decides every one of them) and the
    # hierarchy's overhead inside a host (it is paid once per call, counted as across)
    assert set(measured) == set(calibration.PARAMETERS) - {
        "native.alpha", "native.beta", "overhead.native", "overhead.hierarchical"}
    # The bandwidths dominate big messages and come back closely; the network's latency too.
    assert fitted.network.beta == pytest.approx(TRUTH.network.beta, rel=0.05)
    assert fitted.local.beta == pytest.approx(TRUTH.local.beta, rel=0.25)
    assert fitted.network.alpha == pytest.approx(TRUTH.network.alpha, rel=0.25)
    # And it predicts what it was not fitted on: 4 hosts of 2, 64 MiB, 4 hosts of 1.
    for algorithm, shape in [("ring", Shape(4, 2)), ("hierarchical", Shape(4, 2)),
                             ("tree", Shape(4, 1)), ("native", Shape(3, 2))]:
        for nbytes in (64 << 10, 64 << 20):
            truth = COSTS["all_reduce"][algorithm](nbytes, shape, TRUTH)
            model = COSTS["all_reduce"][algorithm](nbytes, shape, fitted)
            assert model == pytest.approx(truth, rel=0.10), (algorithm, shape, nbytes)
    errs = calibration.summary(calibration.errors(points, fitted))
    assert errs["median_abs_error"] < 0.04


def test_one_host_leaves_the_network_unmeasured():
    points = [p for p in synthetic_points(TRUTH, noise=0.0) if p.ranks == "host"]
    fitted, measured = calibration.fit(points)
    assert "network.beta" not in measured and "network.alpha" not in measured
    assert fitted.network == calibration.START.network  # kept, and reported as such
    assert "not measured here" in calibration.describe(fitted, measured)


# ---- auto beyond what was measured -------------------------------------------------------

def test_auto_asks_the_model_for_this_jobs_transport(monkeypatch):
    """On a host whose ranks each have a core (16), 4 ranks, 16 MiB, the shipped
    constants: through shared memory the ring's relays make it the quickest; over
    gloo's TCP (no relays) halving-doubling's fewer steps win."""
    monkeypatch.setattr(auto.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("COLLECTIVES_MODEL", raising=False)
    auto.model_choice.cache_clear()
    try:
        assert auto.all_reduce_choice(16 << 20, 4, "gloo+shm") == "ring"
        assert auto.all_reduce_choice(16 << 20, 4, "gloo") == "halving-doubling"
    finally:
        auto.model_choice.cache_clear()  # choices for 16 cores: not this machine's


def test_auto_without_a_table_asks_the_model(tmp_path, monkeypatch):
    path = tmp_path / "constants.json"
    path.write_text(json.dumps({"constants": C.as_dict()}))
    monkeypatch.setenv("COLLECTIVES_MODEL", str(path))
    for world, hosts in ((64, Topology(tuple(rank // 8 for rank in range(64)))),  # 8 of 8
                         (4, Topology((0, 0, 1, 1))), (4, None)):
        shape = auto.shape_of(world, hosts)
        for nbytes in (4 << 10, 1 << 20, 64 << 20):
            expected = fastest("all_reduce", nbytes, shape,
                               auto.job_constants(str(path), shape))
            assert auto.all_reduce_choice(nbytes, world, "gloo", hosts) == expected


def test_the_shipped_constants_load_and_answer():
    c = algorithms.costs.load_constants(auto.CALIBRATED)
    for shape in (Shape(1, 16), Shape(64, 8)):
        assert auto.model_choice(1 << 20, shape.hosts, shape.ranks_per_host,
                                 auto.CALIBRATED) in COSTS["all_reduce"]
    assert c.network.beta > 0 and c.local.beta > 0


# ---- the command line, end to end --------------------------------------------------------

def cost_model_command(capsys, *argv) -> str:
    """What `python -m collectives.cost_model argv` prints, run in this process (the
    commands that time nothing: predict, check); it must exit 0."""
    from collectives.cost_model.__main__ import main
    capsys.readouterr()  # what came before is not its
    assert main(list(argv)) in (0, None)
    return capsys.readouterr().out


def test_calibrate_predict_and_check_end_to_end(tmp_path, capsys):
    # calibrate as the command (it spawns its 2 ranks); bench on 2 spawned ranks as a
    # launcher's (launchers.as_launched; its --nproc: test_auto.py's tune); predict and
    # check, which only read files and compute, through the same main() in this process
    out = tmp_path / "here.json"
    done = run(python("-m", "collectives.cost_model", "calibrate", "--nproc", "2", "--out",
                      str(out), "--sizes", "4K,256K", "--trials", "1",
                      "--seconds-per-row", "0.05"))
    assert "fit error over 10 points" in done.stdout  # 5 algorithms x 2 sizes, one host
    saved = json.loads(out.read_text())
    assert len(saved["points"]) == 10 and "local.beta" in saved["measured"]
    assert "network.beta" not in saved["measured"]

    asked = cost_model_command(capsys, "predict", "--constants", str(out), "--hosts", "3",
                               "--ranks-per-host", "2", "--size", "16M",
                               "--bandwidth", "50mbit", "--latency", "2ms")
    rows = [line.split() for line in asked.splitlines() if not line.startswith("#")][1:]
    assert sorted(r[0] for r in rows) == sorted(COSTS["all_reduce"])
    seconds = [float(r[1]) for r in rows]
    assert seconds == sorted(seconds)  # fastest first
    # 16 MiB over 50 Mbit/s links: no algorithm can take less than the ring's bytes allow
    assert seconds[0] > 2 * (5 / 6) * (16 << 20) / (50e6 / 8) / 2

    rows_file = tmp_path / "bench.jsonl"
    run_world(as_launched, 2, backend=None, timeout=200, args=("collectives.bench", [
        "--sizes", "4K,256K", "--algorithms", "ring,tree", "--trials", "1",
        "--seconds-per-row", "0.05", "--no-handshake", "--json", str(rows_file)]))
    checked = cost_model_command(capsys, "check", "--constants", str(out), str(rows_file))
    assert "4 points: median |error|" in checked


def predict_error(capsys, *argv) -> str:
    """The one line `python -m collectives.cost_model predict ...` exits with (status 2)."""
    from collectives.cost_model.__main__ import main
    with pytest.raises(SystemExit) as exited:
        main(["predict", *argv])
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_predict_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "c.json"
    out.write_text(json.dumps({"constants": C.as_dict()}))
    common = ["--constants", str(out), "--hosts", "2", "--size", "1M"]
    assert "no cost model for all_reduce 'bogus'" in predict_error(
        capsys, *common, "--algorithm", "bogus")
    assert "bad rate 'fast'" in predict_error(capsys, *common, "--bandwidth", "fast")
    assert "cannot read constants" in predict_error(
        capsys, "--constants", str(tmp_path / "none.json"), "--hosts", "2", "--size", "1M")
    assert "--hosts and --ranks-per-host must be at least 1" in predict_error(
        capsys, "--constants", str(out), "--hosts", "0", "--size", "1M")


def test_a_shaped_link_passes_its_bucket_at_once_but_not_more_than_its_rate():
    wire = wire_beta(12.5e6)  # 100 Mbit/s
    bucket = 128 << 10
    shaped = Constants(local=Route(0.0, 1e-10), network=Route(0.0, wire), gamma=0.0,
                       overhead={"default": 0.0}, native=Route(0.0, 1e-10),
                       link_rate=12.5e6, burst=bucket)
    tree = COSTS["all_reduce"]["tree"]
    # 1 MiB up the tree and back down, 2 hosts: each level starts on a rested link and
    # passes its bucket at once: 2 (K - bucket) at the wire's pace
    assert tree(1 << 20, Shape(2, 1), shaped) == pytest.approx(2 * ((1 << 20) - bucket) * wire)
    # 64 KiB fits the bucket twice over, but calls back to back leave it no time to
    # fill: each link carries 64 KiB each way per call, at its rate
    assert tree(64 << 10, Shape(2, 1), shaped) == pytest.approx((64 << 10) * wire)
    # a real NIC's link (no bucket) and the same rate: both transfers at the wire's pace
    assert tree(1 << 20, Shape(2, 1), shaped.with_link(12.5e6)) == pytest.approx(
        2 * (1 << 20) * wire)


def test_a_cluster_described_on_the_command_line():
    from collectives.cluster import bucket_bytes
    from collectives.cost_model import on_cluster
    measured = Constants(**{**C.__dict__, "link_rate": 125e6, "burst": 500e3, "cores": 2})
    real = on_cluster(measured, parse_rate("25gbit"), parse_latency("10us"))
    assert (real.burst, real.cores, real.link_rate) == (0.0, 0, 25e9 / 8)
    assert real.network.alpha == pytest.approx(C.network.alpha + 1e-5)
    emulated = on_cluster(measured, parse_rate("100mbit"), emulated=True)
    assert emulated.burst == bucket_bytes(12.5e6) == 128 << 10
    assert emulated.cores == os.cpu_count()
    # the measured link as it was, on real hosts: no bucket, a core per rank
    assert on_cluster(measured).network == measured.network
    assert (on_cluster(measured).burst, on_cluster(measured).cores) == (0.0, 0)
    # ranks sharing cores queue for them with their own work (alpha + overhead: 1.1 ms a
    # step), not with their bytes: 4 busy ranks on 2 cores make a step of 4e6-byte ring
    # at least 2 x 1.1 ms, above 1.1 ms + 1e6 bytes x 1e-9 s of transfer
    crowded = Constants(**{**C.__dict__, "cores": 2})
    assert COSTS["all_reduce"]["ring"](4e6, Shape(1, 4), crowded) == pytest.approx(
        6 * 2 * 1.1e-3 + 3e-4)
    # with 4e7 bytes (a chunk of 1e7: 3 messages of at most 4 MiB) the transfer, 1e-2 s a
    # step, hides the queue (2 x 3.3 ms): as with a core each
    ring = COSTS["all_reduce"]["ring"]
    assert ring(4e7, Shape(1, 4), crowded) == pytest.approx(6 * (3 * 1.1e-3 + 1e-2) + 3e-3)
    assert ring(4e7, Shape(1, 4), crowded) == pytest.approx(ring(4e7, Shape(1, 4), C))


def test_a_tree_broadcast_shares_the_parents_link_among_its_children():
    # broadcast() posts every send of a parent at once: on 4 hosts of 1 the root's two
    # sends share its link (1e-2 + 1e-4 + 2 x 1e6 x 1e-8 each), then rank 2 sends on
    # to rank 3 alone (2.01e-2)
    assert COSTS["broadcast"]["tree"](1e6, Shape(4, 1), C) == pytest.approx(3.01e-2 + 2.01e-2)


def main_error(capsys, *argv) -> str:
    """The one line `python -m collectives.cost_model ...` exits with (status 2)."""
    from collectives.cost_model.__main__ import main
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_calibrate_and_check_refuse_bad_input(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    assert "calibrate needs 2 ranks or more" in main_error(
        capsys, "calibrate", "--out", str(tmp_path / "c.json"))
    constants = tmp_path / "c.json"
    constants.write_text(json.dumps({"constants": C.as_dict()}))
    assert "not a sweep calibrate wrote" in main_error(
        capsys, "calibrate", "--points", str(constants), "--out", str(tmp_path / "d.json"))
    assert "cannot read constants" in main_error(
        capsys, "check", "--constants", str(tmp_path / "none.json"), str(constants))


def test_auto_without_a_table_reads_its_constants_for_this_jobs_machines(
        tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_MODEL", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot read the cost model's constants"):
        auto.all_reduce_choice(1 << 20, 64, "gloo", Topology(tuple(r // 8 for r in range(64))))
    crowded = Constants(**{**C.__dict__, "cores": 2, "burst": 1e6, "link_rate": 125e6})
    path = tmp_path / "emulated.json"
    path.write_text(json.dumps({"constants": crowded.as_dict()}))
    real = auto.job_constants(str(path), Shape(8, 8))
    assert (real.cores, real.burst) == (0, 0.0)  # real hosts: a core each, no tbf bucket
    alone = auto.job_constants(str(path), Shape(1, 16))
    assert alone.cores == os.cpu_count()  # one machine's ranks share its cores
    emulated = auto.job_constants(str(path), Shape(8, 1), emulated_rate=12.5e6)
    assert emulated.cores == os.cpu_count() and emulated.burst == 128 << 10
