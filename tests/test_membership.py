"""The elastic job's membership: generations agreed through a store outside the ranks."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from collectives.elastic import Membership, MembershipError
from collectives.elastic.store import serve

FAST = dict(settle=0.3, beat=0.1, dead_after=1.0, timeout=3.0)
_made = []  # every Membership a test made: its heartbeat stops when the test ends


@pytest.fixture
def store():
    served = serve(0)
    yield served
    while _made:
        _made.pop().leave()
    del served


def members(store, names, **options):
    made = [Membership("127.0.0.1", store.port, name, **{**FAST, **options}) for name in names]
    _made.extend(made)
    return made


def join_all(group, **kwargs):
    with ThreadPoolExecutor(len(group)) as pool:
        return list(pool.map(lambda m: m.join(**kwargs), group))


@pytest.mark.timeout(60)
def test_the_first_generation_holds_everyone_in_the_order_they_came(store):
    group = members(store, ["a", "b", "c", "d"])
    views = join_all(group, expected=4)
    assert {v.generation for v in views} == {0}
    assert len({v.members for v in views}) == 1 and sorted(views[0].members) == list("abcd")
    assert sorted(v.rank for v in views) == [0, 1, 2, 3]
    for m in group:
        m.leave()


@pytest.mark.timeout(60)
def test_survivors_form_the_next_generation_once_the_dead_stop_beating(store):
    group = members(store, ["a", "b", "c", "d"])
    first = join_all(group, expected=4)[0].members
    group[2].leave()  # c dies: its heartbeat stops, and it never registers again
    started = time.monotonic()
    views = join_all([group[0], group[1], group[3]])
    waited = time.monotonic() - started
    survivors = tuple(m for m in first if m != "c")
    assert {v.members for v in views} == {survivors}, "survivors keep their order"
    assert {v.generation for v in views} == {1}
    # c's last beat may come up to a beat (and its reads) before it left: watched since
    assert FAST["dead_after"] - 2 * FAST["beat"] <= waited < FAST["dead_after"] + 10.0, waited
    for m in (group[0], group[1], group[3]):
        m.leave()


@pytest.mark.timeout(60)
def test_a_member_silent_since_the_step_began_is_known_dead_when_the_others_ask(store):
    """A cut link is found only at the transport's timeout. By then the member cut off
    has not beaten for that long, and every heartbeat thread has watched its
    generation's members all along: the survivors go on after `settle`, not
    `dead_after` after they ask."""
    group = members(store, ["a", "b", "c"], dead_after=4.0)
    join_all(group, expected=3)
    group[2].leave()  # c falls silent...
    time.sleep(5.0)  # ...while a and b are inside a step that ends at their timeout
    started = time.monotonic()
    views = join_all(group[:2])
    waited = time.monotonic() - started
    assert len({v.members for v in views}) == 1 and sorted(views[0].members) == ["a", "b"]
    assert waited < 2.0, waited  # settle is 0.3 s; c was dead (4 s silent) before we asked
    for m in group[:2]:
        m.leave()


@pytest.mark.timeout(60)
def test_a_member_back_from_silence_is_taken_in_before_its_heartbeat_resumes(store):
    """A member whose link was cut comes back and registers before its heartbeat thread
    reaches the store again. The others watched it fall silent for longer than
    dead_after; its registration and its waiting are beats of their own, so it is
    alive and in the next generation."""
    group = members(store, ["a", "b", "c"], dead_after=2.0)
    join_all(group, expected=3)
    group[2]._heart.stop()  # c's heartbeat thread stops (c itself goes on)
    group[2]._heart.join(10)
    time.sleep(3.0)  # silent for longer than dead_after, as the others see it
    views = {}
    # expected=3: the generation waits for all three to register (up to its timeout),
    # so the outcome turns only on whether c is taken for alive
    joining = [threading.Thread(target=lambda m=m: views.update({m.me: m.join(expected=3)}),
                                daemon=True)  # daemons: one left waiting fails the test
               for m in group]
    for thread in joining:
        thread.start()
    for thread in joining:
        thread.join(timeout=20.0)
    assert sorted(views) == ["a", "b", "c"], f"left waiting: {set('abc') - set(views)}"
    assert {v.members for v in views.values()} == {views["a"].members}
    assert sorted(views["a"].members) == ["a", "b", "c"]
    for m in group:
        m.leave()


@pytest.mark.timeout(60)
def test_a_live_member_is_waited_for_until_it_registers(store):
    # b is alive (beating) but blocked, say in a collective, for 2 s past dead_after
    group = members(store, ["a", "b", "c"])
    join_all(group, expected=3)

    def late(m):
        time.sleep(FAST["dead_after"] + 2.0)
        return m.join()

    with ThreadPoolExecutor(3) as pool:
        views = [pool.submit(group[0].join), pool.submit(late, group[1]),
                 pool.submit(group[2].join)]
        views = [v.result() for v in views]
    assert {v.world_size for v in views} == {3}
    for m in group:
        m.leave()


@pytest.mark.timeout(60)
def test_a_newcomer_is_seen_and_joins_last(store):
    group = members(store, ["a", "b"])
    join_all(group, expected=2)
    (newcomer,) = members(store, ["e"])
    with ThreadPoolExecutor(1) as pool:
        arriving = pool.submit(newcomer.join)
        deadline = time.monotonic() + 10
        while group[0].newcomers() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group[0].newcomers() == group[1].newcomers() == 1
        views = join_all(group)
        views.append(arriving.result())
    assert {v.members for v in views} == {("a", "b", "e")} or \
        {v.members for v in views} == {("b", "a", "e")}
    assert views[-1].rank == 2 and {v.generation for v in views} == {1}
    for m in [*group, newcomer]:
        m.leave()


@pytest.mark.timeout(60)
def test_below_min_ranks_every_member_ends_with_one_clear_error(store):
    group = members(store, ["a", "b", "c"], min_ranks=3)
    join_all(group, expected=3)
    group[2].leave()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(m.join) for m in group[:2]]
        errors = []
        for future in futures:
            with pytest.raises(MembershipError) as raised:
                future.result()
            errors.append(str(raised.value))
    assert all("2 member(s) left, fewer than the 3 needed" in e for e in errors), errors


@pytest.mark.timeout(60)
def test_a_lost_store_is_named_and_a_restarted_one_is_told_apart(store):
    lonely = serve(0)
    (member,) = members(lonely, ["z"])
    member.join(expected=1)
    assert member.newcomers() == 0
    port = lonely.port
    del lonely  # the store's process is gone: the next change of membership says so
    assert member.newcomers() == 0, "a running generation does not stall on the store"
    with pytest.raises(MembershipError,
                       match=r"the membership store at 127.0.0.1:\d+ does not answer"):
        member.join()
    again = serve(port)  # back on the same port, but empty
    with pytest.raises(MembershipError, match="was restarted"):
        member.join()
    del again


@pytest.mark.timeout(60)
def test_a_finished_job_turns_newcomers_away_and_max_ranks_leaves_no_place(store):
    group = members(store, ["a", "b"], max_ranks=2)
    join_all(group, expected=2)
    (late,) = members(store, ["e"], max_ranks=2)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(late.join)
        deadline = time.monotonic() + 10
        while group[0].store.add("generation 1/count", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group[0].newcomers() == 0, "no place for e within max_ranks"
        group[0].finish()
        for m in group:
            m.leave()
        with pytest.raises(MembershipError, match="finished"):
            waiting.result()
