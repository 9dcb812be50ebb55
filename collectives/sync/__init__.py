"""Sync strategies, one file each, registered by name. See base.py for the interface.

    allreduce    average every gradient bucket during backward (what DDP does)
    local-sgd    train alone, average the models every H steps (post-local SGD)
    hier-local-sgd  average inside each host often, across hosts every H steps
    diloco       train alone H steps, then an outer Nesterov step on the averaged change
                 (streaming: one fragment of the model at a time, overlapped)
    async-avg    average the models on a background thread, no per-step barrier
    delayed      all-reduce step t's gradients during step t+1, apply them late
    gossip       average with ring neighbours only, no global collective
    fp16, bf16   average gradients in 16 bits
    topk         send the largest 1% of each bucket, keep the rest as error feedback
    powersgd     send rank-r factors of each gradient matrix, with error feedback
    sparseloco   diloco with error feedback in place of outer momentum; top-k of each
                 chunk of the pseudo-gradient, in 2 bits, all-gathered
    demo         momentum kept on each rank; the top DCT coefficients of each tile
                 all-gathered every step, the optimizer steps on the sign
    muloco       diloco whose pseudo-gradient is compressed with error feedback (top-k
                 per chunk, or every entry in 2/4/8 bits), all-gathered; MuLoCo with
                 the trainer's --optimizer muon
    noloco       diloco's outer step with one random peer at a time, no all-reduce
    onebit-adam  Adam inside the strategy: a full-precision warm-up, then v frozen and
                 the momentum all-reduced in 1 bit with worker and server error feedback
    sparta       average a random 0.5 % of the parameters every step (+ diloco)

Every module in this folder is imported here, so a new strategy is one new file with
an `@register("name")` class: nothing else to edit (docs/writing_a_sync_strategy.md).
Its options are its constructor's keyword arguments, spelled after the name wherever a
strategy is named: `create("local-sgd:period=8")`; options.py converts and checks them.
"""
import importlib
import pkgutil

from . import options
from .base import SyncStrategy, available, create, finite, parse, register, strategy_class

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["SyncStrategy", "available", "create", "finite", "options", "parse", "register",
           "strategy_class"]
