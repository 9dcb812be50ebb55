"""`auto`'s choices: NCCL's own, a tuning table's, and how init finds and agrees on one.

The choice is a function of (bytes, world size, transport name, topology, table), so a
topology of several hosts can be written down instead of built.
"""
import json
import os
import subprocess
from datetime import timedelta

import pytest
import torch

import collectives
import collectives.transport.local
from collectives import api
from collectives.algorithms import auto, tuning
from collectives.transport.topology import Topology
from distributed import run_world
from launchers import as_launched, python, rank_env, run

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]
TWO_HOSTS = {
    "2 hosts of 2 ranks": Topology((0, 0, 1, 1)),
    "2 hosts of 4 ranks": Topology((0, 0, 0, 0, 1, 1, 1, 1)),
    "2 hosts of 1 rank": Topology((0, 1)),
    "hosts of 1 and 3 ranks": Topology((0, 1, 1, 1)),
}


@pytest.mark.parametrize("placement", list(TWO_HOSTS))
def test_nccl_across_hosts_keeps_nccls_own_all_reduce(placement):
    """NCCL runs its own rings and trees across nodes; ours would drive a second NCCL
    communicator from a second thread (hierarchical's pipeline), which NCCL documents
    as a possible deadlock. Across hosts on nccl, auto must say native at every size."""
    topology = TWO_HOSTS[placement]
    n = len(topology.host_of)
    chosen = {size: auto.all_reduce_choice(size, n, "nccl", topology) for size in SIZES}
    assert set(chosen.values()) == {"native"}, chosen


# --- tuning tables (collectives/algorithms/tuning.py) ---------------------------------------

def a_key(**changes):
    key = {"transport": "gloo+shm", "world_size": 4, "hosts": 1, "ranks_per_host": 4,
           "cores": os.cpu_count(), "link_bits": 0}
    return {**key, **changes}


def test_rules_switch_halfway_between_rungs_whose_winners_differ():
    sizes = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]
    times = {"naive": [10, 50, 900, 9000], "tree": [20, 40, 500, 8000],
             "ring": [90, 80, 600, 5000]}
    rules = tuning.rules_from_times(sizes, times)
    assert rules == [(16 * KiB, "naive"), (4 * MiB, "tree"), (None, "ring")]
    table = tuning.Table(a_key(), tuple(rules))
    assert [table.choose(n) for n in (1, 16 * KiB - 1, 16 * KiB, 4 * MiB, 1 << 30)] == [
        "naive", "naive", "tree", "ring", "ring"]
    assert tuning.rules_from_times(sizes[:1], {"tree": [1], "ring": [2]}) == [(None, "tree")]


def test_tune_looks_again_halfway_where_the_quickest_changes():
    measured = {4 * KiB: {"naive": 10, "tree": 20}, 16 * KiB: {"naive": 30, "tree": 40},
                64 * KiB: {"naive": 90, "tree": 60}, 256 * KiB: {"naive": 300, "tree": 200},
                256 * KiB + 4: {"naive": 100, "tree": 300}}
    # only between neighbours whose winners differ, and only where a size fits between
    assert tuning.between_winners(measured) == [32 * KiB]
    measured[32 * KiB] = {"naive": 50, "tree": 45}
    assert tuning.between_winners(measured) == [int((16 * KiB * 32 * KiB) ** 0.5) // 4 * 4]


def test_auto_follows_a_table_and_says_where_its_choice_comes_from(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("COLLECTIVES_TUNING", raising=False)
    key = a_key()
    table, source = tuning.find(key)
    assert table is None and "no table: python -m collectives.tune" in source
    path = os.path.join(tuning.cache_folder(), tuning.file_name(key))
    tuning.write(key, [4 * KiB, 16 * MiB], {"naive": [1, 9], "ring": [5, 2]}, path)
    table, source = tuning.find(key)
    assert source == f"the table {path}"
    for nbytes, expected in ((4 * KiB, "naive"), (16 * MiB, "ring")):
        assert auto.all_reduce_choice(nbytes, 4, "gloo+shm", None, table=table) == expected
    # a table for another machine is not used, and the source says why
    monkeypatch.setenv("COLLECTIVES_TUNING", path)
    table, source = tuning.find(a_key(cores=os.cpu_count() + 1))
    assert table is None and "is for another world: cores" in source
    with open(path, "w") as broken:
        broken.write("{")
    table, source = tuning.find(key)
    assert table is None and "unreadable" in source


def found_and_chosen(comm):
    return comm.tuning_source, collectives.api._auto("all_reduce", 16 * MiB, comm)


def different_tables(comm):
    table = tuning.Table(a_key(world_size=2), ((None, "ring" if comm.rank else "tree"),))
    return tuning.agree(comm, table, "the table here")[0] is None


@pytest.mark.timeout(180)
def test_init_finds_the_table_and_the_ranks_agree_on_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("COLLECTIVES_TUNING", raising=False)
    key = a_key(world_size=2, ranks_per_host=2)
    path = os.path.join(tuning.cache_folder(), tuning.file_name(key))
    tuning.write(key, [4 * KiB], {"naive": [1], "ring": [5]}, path)
    assert run_world(found_and_chosen, 2, shm="on") == [(f"the table {path}", "naive")] * 2
    # ranks holding different tables follow none: the cost model, alike everywhere
    assert run_world(different_tables, 2) == [True, True]


def test_the_hierarchy_is_a_candidate_only_where_it_has_two_levels():
    assert "hierarchical" in tuning.candidates(Topology((0, 0, 1, 1)))
    for one_level in (None, Topology.one_host(4), Topology((0, 1, 2, 3))):
        assert tuning.candidates(one_level) == list(tuning.CANDIDATES)


def test_auto_remembers_its_choice_but_not_across_tables():
    comm = collectives.transport.local.LocalTransport(torch.device("cpu"), timedelta(seconds=9))
    comm.world_size, comm.topology = 4, Topology.one_host(4)
    for algorithm in ("naive", "ring", "naive"):
        comm.tuning = tuning.Table(a_key(), ((None, algorithm),))
        assert api._auto("all_reduce", 64 * KiB, comm) == algorithm
    comm.tuning = None
    assert api._auto("all_reduce", 64 * KiB, comm) == auto.all_reduce_choice(
        64 * KiB, 4, comm.name, comm.topology)
    one_host = api._auto("all_reduce", 64 * MiB, comm)
    comm.topology = Topology((0, 0, 1, 1))  # the placement init finds replaces the first
    two_hosts = auto.all_reduce_choice(64 * MiB, 4, comm.name, comm.topology)
    assert two_hosts != one_host and api._auto("all_reduce", 64 * MiB, comm) == two_hosts


def python_m(module: str, *args: str, env=None) -> subprocess.CompletedProcess:
    """`python -m module args` as a user starts it (no launcher's variables)."""
    return run(python("-m", module, *args), env=rank_env(**(env or {})), timeout=200)


@pytest.mark.timeout(240)
def test_tune_writes_a_table_init_then_follows(tmp_path, monkeypatch):
    out = tmp_path / "table.json"
    result = python_m("collectives.tune", "--nproc", "2", "--sizes", "4K,64K",
                      "--seconds-per-row", "0.05", "--trials", "1", "--out", str(out),
                      env={"XDG_CACHE_HOME": str(tmp_path)})
    table = tuning.Table.load(str(out))
    assert table.key == tuning.key_for("gloo+shm", 2, None) | {"ranks_per_host": 2}
    written = json.loads(out.read_text())  # the sizes in order, the times beside them
    assert written["sizes"] == sorted(written["sizes"]) and len(written["sizes"]) in (2, 3)
    assert all(len(t) == len(written["sizes"]) for t in written["times_us"].values())
    assert table.rules[-1][0] is None and "# rules:" in result.stdout
    # bench, timing the algorithms in turns, says what each source of auto's choice
    # would run at each size and how it compares with the quickest (on 2 spawned ranks
    # as a launcher's: launchers.as_launched; tune above went through --nproc)
    rows = tmp_path / "rows.jsonl"
    monkeypatch.setenv("COLLECTIVES_TUNING", str(out))
    printed = run_world(as_launched, 2, backend=None, timeout=200, args=(
        "collectives.bench", ["--sizes", "4K,64K", "--in-turns", "--algorithms",
                              "ring,halving-doubling,tree,naive,native,auto",
                              "--seconds-per-row", "0.05", "--trials", "1", "--no-handshake",
                              "--json", str(rows)]))[0]
    assert f"# auto follows the table {out}" in printed
    autos = [row for row in map(json.loads, rows.read_text().splitlines())
             if row["algorithm"] == "auto"]
    assert [row["bytes"] for row in autos] == [4 * KiB, 64 * KiB]
    for row in autos:
        assert row["in_turns"] and set(row["auto_over_quickest"]) == {"table", "model"}
        assert min(row["auto_over_quickest"].values()) >= 1.0
        chosen = table.choose(row["bytes"])
        assert f"table {chosen} " in printed
