"""`torchft-diloco`: torchft's DiLoCo, the peer of our `diloco`, driven like our strategies.

torchft (pip install torchft, or this project's `torchft` extra) runs DiLoCo for
fault-tolerant training: every rank here is a replica group of its own, a Manager per
rank joins a quorum at a lighthouse, and DiLoCo (torchft/local_sgd.py) averages the
pseudo-gradients through the Manager's process group (gloo), fragment by fragment. The
pieces it needs, and where they come from here:

    lighthouse     a LighthouseServer inside rank 0 (torchft runs it as a process of its
                   own on real clusters), waiting for all world_size replicas: its
                   address goes to every rank over torch.distributed
    store          one TCPStore per rank: its replica group's store (a group of one)
    Manager        synchronous quorum (DiLoCo requires it), no healing at step 0: every
                   rank starts from rank 0's broadcast weights (init_sync=False)
    fragments      the same contiguous runs of parameters as ours
                   (collectives/sync/diloco.py: split_into_fragments), one outer SGD
                   with Nesterov momentum per fragment
    inner steps    DiLoCo acts from hooks on the inner optimizer's step. The trainer
                   makes its optimizer after wrapping the model, so DiLoCo is given a
                   stand-in optimizer that after_step steps (it changes nothing: no
                   parameters of the model, learning rate 0).

Where torchft's computation differs from ours: nowhere in the math (sum by gloo, then
divide by the replicas, as ours averages; the tests check bitwise equality in float64
on 2 ranks). It adds a quorum round at every fragment synchronization, and its
should_commit() check, which ours has no need of (a failure is a PeerError here).
"""
from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from typing import Any, Dict

import torch
import torch.distributed as dist

from collectives.sync.diloco import check_outer, check_schedule, split_into_fragments
from .peer_base import Peer


class TorchftDiLoCo(Peer):
    """torchft's DiLoCo on this process group, with our diloco's options."""

    uses_buckets = False
    replicas_differ = True

    def __init__(self, period: int = 8, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, delay: int = 0,
                 alpha: float = 0.0, timeout: float = 60.0):
        # torchft's Rust side logs every quorum at INFO: keep to warnings unless asked
        os.environ.setdefault("RUST_LOG", "warn")
        try:
            import torchft  # noqa: F401
        except ImportError as error:
            raise RuntimeError("torchft-diloco needs torchft: pip install torchft "
                               f"(or this project's [torchft] extra): {error}") from None
        check_schedule("torchft-diloco", period, fragments, delay)
        check_outer("torchft-diloco", outer_lr, outer_momentum, nesterov, alpha)
        self.name, self.period, self.warmup_steps = "torchft-diloco", period, 0
        self.syncs_per_period = fragments  # one fragment every period / fragments steps
        self.options = dict(period=period, fragments=fragments, delay=delay, alpha=alpha)
        self.outer_options = dict(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        self.timeout = timedelta(seconds=timeout)
        self.traffic, self.hook_state, self.averager = None, None, None
        self.bucket_intervals = []
        self.diloco = None

    def wrap(self, model: torch.nn.Module, bucket_cap_mb=None,
             observed: bool = False) -> torch.nn.Module:
        """The model with nothing around it (DiLoCo sends nothing during backward: no
        DDP), and torchft's Manager and DiLoCo set up beside it. Collective over the
        default group."""
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        if not dist.is_initialized():
            raise RuntimeError("torchft-diloco needs torch.distributed (backend gloo), "
                               "not the mpi backend")
        rank, world = dist.get_rank(), dist.get_world_size()
        self.lighthouse = (LighthouseServer(bind="[::]:0", min_replicas=world)
                           if rank == 0 else None)
        address = [self.lighthouse.address() if rank == 0 else None]
        dist.broadcast_object_list(address, src=0)
        self.store = dist.TCPStore(socket.gethostname(), 0, is_master=True,
                                   wait_for_workers=False)
        # max_retries=0: a failed exchange raises at its commit, as a PeerError does in
        # ours (by default torchft would drop the fragment's steps and go on).
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=self.timeout), min_replica_size=world,
            use_async_quorum=False, init_sync=False, load_state_dict=None, state_dict=None,
            replica_id=f"rank{rank}", store_addr=socket.gethostname(),
            store_port=self.store.port, rank=0, world_size=1,
            lighthouse_addr=address[0], timeout=self.timeout, max_retries=0,
            quorum_timeout=self.timeout, connect_timeout=self.timeout)
        self.fragments = [torch.nn.ParameterList(run) for run in split_into_fragments(
            list(model.parameters()), self.options["fragments"])]
        outer = [torch.optim.SGD(fragment.parameters(), **self.outer_options)
                 for fragment in self.fragments]
        # DiLoCo runs from the step hooks of this stand-in for the inner optimizer.
        self.stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        self.diloco = DiLoCo(self.manager, self.fragments, self.stand_in, outer,
                             sync_every=self.options["period"],
                             backup_device=next(model.parameters()).device, pin_memory=False,
                             fragment_sync_delay=self.options["delay"],
                             fragment_update_alpha=self.options["alpha"]).__enter__()
        self.every = self.options["period"] // self.options["fragments"]
        self.sent_from = None  # the weights of the fragment in flight, when it was sent
        self.module = model
        return _WithoutDDP(model)

    def _in_flight(self) -> bool:
        """A fragment has been sent and not yet merged (only with a delay)."""
        return self.every - self.options["delay"] <= self.diloco._local_step < self.every

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        self.stand_in.step()  # DiLoCo's post-step hook: send or merge a fragment
        if self.options["delay"] and self.diloco._local_step == self.every - self.options["delay"]:
            fragment = self.fragments[self.diloco._current_fragment()]
            self.sent_from = [p.detach().clone() for p in fragment.parameters()]

    def _wait_in_flight(self) -> None:
        for fragment in self.diloco._fragments:
            for work in fragment._allreduce_work:
                work.wait()

    def settle(self) -> None:
        """Wait for a fragment in flight (every rank has sent the same one)."""
        self._wait_in_flight()

    def close(self) -> None:
        """Wait for a fragment in flight, then leave together: every rank's exchanges
        are over before any Manager stops, and rank 0's lighthouse stops last."""
        if self.diloco is None:
            return
        try:
            self._wait_in_flight()
            dist.barrier()
        finally:
            self.diloco.__exit__(None, None, None)
            self.diloco = None
            try:
                self.manager.shutdown(wait=False)
            finally:
                if self.lighthouse is not None:
                    self.lighthouse.shutdown()

    def state_dict(self) -> Dict[str, Any]:
        """What torchft itself checkpoints: the Manager's step (which picks the next
        fragment), each fragment's synced weights and outer optimizer (through the
        functions DiLoCo registered with the Manager), and the inner steps since the
        last synchronization; with a fragment in flight, the weights it was sent from."""
        fragments = {key: save() for key, save in self.manager._user_state_dicts.items()}
        state = {"manager": self.manager.state_dict(), "fragments": fragments,
                 "local_step": self.diloco._local_step}
        if self._in_flight():
            state["sent_from"] = [t.clone() for t in self.sent_from]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from state_dict(). A fragment that was in flight at the save is sent
        again, from the weights it was sent from, as DiLoCo's own hook sent it (a new
        quorum, then prepare_sync), while the replica keeps its later weights."""
        self.manager.load_state_dict(state["manager"])
        for key, value in state["fragments"].items():
            self.manager._load_state_dict_fns[key](value)
        self.diloco._local_step = state["local_step"]
        if self._in_flight():
            index = self.diloco._current_fragment()
            params = list(self.fragments[index].parameters())
            now = [p.detach().clone() for p in params]
            self.sent_from = [t.to(p.device) for t, p in zip(state["sent_from"], params)]
            for p, sent in zip(params, self.sent_from):
                p.copy_(sent)
            self.manager.start_quorum()
            self.diloco._fragments[index].prepare_sync()
            for p, later in zip(params, now):
                p.copy_(later)


class _WithoutDDP(torch.nn.Module):
    """The model as it is, with DDP's no_sync() (there is nothing to hold back): what
    the trainer and trainer.bench call around steps that must not communicate."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return contextlib.nullcontext()
