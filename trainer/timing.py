"""Measuring a training step's communication the same way for our DDP and torch's.

Two figures the trainer and trainer.bench report for every sync, ours or torch's:

waited: seconds the training thread could not compute because of communication. In
    backward it is the tail (WaitClock says exactly which span); outside backward it
    is the time spent in the strategy's after_backward and after_step moments
    (PowerSGD's reductions, local SGD's model averaging).

bytes sent: what our transports send, by whatever route (TCP or shared memory), they
    count (`traffic`): our strategies' communicator's, and for ddp-collectives (torch's
    DDP on our torch.distributed backend) the transport that backend runs on. gloo's
    collectives (the other torch peers) are invisible to them, so for those the
    kernel's own count is read: the bytes every TCP socket of this process has had
    acknowledged (TCP_INFO), which is what gloo sent, over loopback on one host too.
    On the emulated cluster the NIC counters count everything.
"""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from typing import Optional

import torch

import collectives
from collectives import trace
from collectives.launch import links
from .peer_base import Peer

_TCP_INFO_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in struct tcp_info


class WaitClock:
    """Adds up the seconds the training thread waits on communication.

    backward's tail runs from the moment autograd has computed the last parameter's
    gradient to the moment backward() returns. The start is taken by a hook on each
    parameter's gradient (Tensor.register_hook), which autograd calls with the freshly
    computed gradient before it is accumulated into .grad, and so before any DDP sees
    it: our bucketer's hooks (post-accumulate) and torch's Reducer's (on the gradient
    accumulator, after those) both run later, whichever was registered first. All that
    a DDP does after the last gradient is computed is then counted, the same for ours
    and torch's: copying that gradient into its bucket, launching the last bucket, and
    waiting until every bucket has been reduced and written back to .grad (both wait
    inside backward() for that). The compute of backward is not counted; neither is
    the DDP's work on earlier gradients, which runs between pieces of compute. A
    no_sync() backward has almost no tail.

    blocking() sections (the strategy's moments) are waiting in full.
    """

    def __init__(self, model: torch.nn.Module):
        self.waited = 0.0
        self.in_hooks = 0.0  # the part of `waited` spent in blocking() sections
        self._last_ready: Optional[int] = None  # perf_counter_ns of the last gradient
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(self._computed)

    def _computed(self, grad: torch.Tensor) -> None:
        """A parameter's gradient is computed (not yet in .grad): its time, unchanged."""
        self._last_ready = time.perf_counter_ns()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), counting its communication tail (a "wait" span in a trace)."""
        with trace.span("backward", cat="compute"):
            loss.backward()
        if self._last_ready is not None:
            now = time.perf_counter_ns()
            self.waited += (now - self._last_ready) / 1e9
            trace.add("waiting on communication", "wait", self._last_ready, now)
            self._last_ready = None

    @contextlib.contextmanager
    def blocking(self, name: str = "sync hook"):
        """Time inside this block is waiting (a strategy's after_backward / after_step)."""
        started = time.perf_counter_ns()
        try:
            yield
        finally:
            now = time.perf_counter_ns()
            self.waited += (now - started) / 1e9
            self.in_hooks += (now - started) / 1e9
            trace.add(name, "wait", started, now)

    def reset(self) -> None:
        self.waited = self.in_hooks = 0.0


def tcp_bytes_sent() -> Optional[int]:
    """Bytes this process's open TCP sockets have sent (and had acknowledged), from
    the kernel; None where that cannot be read (not Linux)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    total = 0
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if probe.type == socket.SOCK_STREAM and probe.family in (socket.AF_INET,
                                                                     socket.AF_INET6):
                info = probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= _TCP_INFO_BYTES_ACKED + 8:
                    total += struct.unpack_from("Q", info, _TCP_INFO_BYTES_ACKED)[0]
        except OSError:
            pass
        finally:
            probe.close()
    return total


class SentBytes:
    """Bytes this rank has sent so far: its host's NIC on the emulated cluster (shared
    by the ranks of the host), else the counter of the transport of ours that carries
    the sync's collectives, or for torch's DDP on gloo the kernel's count for this
    process's TCP sockets.

    strategy: our sync strategy (its collectives run on `comm`) or a peer
    (trainer/peer_base.py: its `traffic` once wrapped, None on gloo)."""

    def __init__(self, comm, strategy):
        self.comm, self.strategy = comm, strategy
        self.ranks_on_host = collectives.detect_launch().local_world_size or 1

    def read(self) -> float:
        nic = links.link_bytes()
        if nic is not None:
            return nic["sent"] / self.ranks_on_host
        if not isinstance(self.strategy, Peer):
            return self.comm.traffic.bytes_sent
        if self.strategy.traffic is not None:  # ddp-collectives: our backend's transport
            return self.strategy.traffic.bytes_sent
        return tcp_bytes_sent() or 0


def _comm_workers(ddp, strategy) -> list:
    """The communication threads of our DDP's bucketer and of a strategy (delayed's,
    async-avg's), where they have one; torch's DDP and peers have none."""
    workers = [getattr(getattr(ddp, "bucketer", None), "worker", None),
               getattr(strategy, "worker", None)]
    return [worker for worker in workers if worker is not None]


def background_comm_seconds(ddp, strategy) -> float:
    """Seconds the communication threads (the bucketer's, a strategy's) have been busy."""
    return sum(worker.busy_seconds for worker in _comm_workers(ddp, strategy))


def drain_background(ddp, strategy) -> None:
    """Collective: wait until the communication threads have finished what this step
    started, on every rank alike.

    A strategy that communicates in the background (delayed's last all-reduce,
    async-avg's averaging round) still sends after the step that started it returns;
    a measurement that ends there must drain it first, or those bytes and seconds land
    in whatever is measured next. The strategy settles its own (`settle`: async-avg's
    ranks may be a round apart, and must agree on which round to finish); our DDP's
    bucketer finishes every bucket inside backward already. Its state is untouched:
    the next step finds the result ready, as if the network had been fast. (overlap=
    forward's step is finished by its stepper's flush() first.)"""
    bucketer = getattr(ddp, "bucketer", None)
    if bucketer is not None:
        bucketer.worker.drain()
    strategy.settle()
