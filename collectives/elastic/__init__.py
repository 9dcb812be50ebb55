"""Elastic training: the job shrinks when a rank is lost and grows when one comes.

    store.py        the membership store: a process of its own that outlives every rank
    membership.py   who is in, generation by generation: join, newcomers, leave
    generations.py  ElasticWorld: the communicator, built again for each generation
    state.py        State (commit, restore, sync) and run(): the loop that goes on
    sampler.py      ElasticSampler: the rest of the epoch over the ranks there are now

docs/elastic.md walks through a loop of one's own.
"""
from .generations import ElasticWorld
from .membership import JobFinished, Membership, MembershipError, View
from .sampler import ElasticSampler
from .state import MembersChanged, State, run

__all__ = ["ElasticSampler", "ElasticWorld", "JobFinished", "Membership", "MembershipError", "MembersChanged",
           "State", "View", "run"]
