"""gloo and nccl through torch.distributed.

torch.distributed already runs a process group per backend; this transport is a thin
layer over its point-to-point calls. Two backend facts shape it:

- gloo moves CPU tensors over TCP; its send/recv do not take CUDA tensors, so those
  are staged through host memory by the base class.
- nccl moves CUDA tensors only. Its group is built beside gloo, as torch builds a
  mixed one ("cpu:gloo,cuda:nccl", world.py): CPU tensors (the bookkeeping of call
  checks, votes, host tables) go to gloo and only CUDA data to NCCL. A group that has
  NCCL alone (a script's `init_process_group("nccl")`, adopted) gets a gloo group
  beside it for the CPU tensors (`cpu_group`).
- NCCL runs a rank's postings one after another on one stream, each to its end
  (every `batch_isend_irecv` is one NCCL group): a receive posted ahead blocks every
  posting behind it, the send its own sender waits for included. So the transport is
  `step_by_step`: algorithms post each step's sends and receives together
  (`exchange()`, one group), as NCCL's documentation asks, and nothing ahead.
- NCCL has no int16 and no bitwise reductions: int16 is reduced in int32 and band,
  bor and bxor bit by bit (MIN, MAX and SUM over one byte per bit), both exact.

gloo's calls go straight to the group's own object (`ProcessGroup.send`, ...), with
group ranks. So the same code serves a group torch.distributed knows (made by
`init_process_group` or `new_group`) and a gloo instance torch never registered: the
torch.distributed backend of this project (torch_backend/) builds one per group
from the store torch hands it (`TorchDistTransport.over_store`).

A send or receive that fails (when posted, or on its wait) or times out is re-raised as
PeerError naming the peer.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Dict, List, Set, Tuple

import torch
import torch.distributed as dist

from .base import Handle, PeerError, Transport

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND,
              "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


# The dtypes gloo's collectives take (int16, for one, is refused: "Invalid scalar type").
_GLOO_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                torch.uint8, torch.int32, torch.int64)
# The dtypes NCCL reduces (torch maps bool to NCCL's uint8; int16 is refused: "Input
# tensor data type is not supported for NCCL process group: Short").
_NCCL_DTYPES = _GLOO_DTYPES + (torch.bool,)
# band, bor and bxor on one byte per bit, which NCCL can reduce (MIN, MAX, SUM mod 2).
_BITWISE_BY_BIT = {"band": dist.ReduceOp.MIN, "bor": dist.ReduceOp.MAX,
                   "bxor": dist.ReduceOp.SUM}



def _peer_error(what: str, error: RuntimeError, timeout: timedelta) -> PeerError:
    """torch's RuntimeError about a peer, as our PeerError: what failed, first line."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if "timed out" in first_line.lower():  # gloo's "Operation timed out!"
        first_line = (f"no answer within the timeout of "
                      f"{timeout.total_seconds():g} s ({first_line})")
    return PeerError(f"{what} failed: {first_line}")


def open_sockets() -> Dict[int, int]:
    """This process's open sockets: {inode: file descriptor}, read from /proc (empty
    where there is none)."""
    found: Dict[int, int] = {}
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in descriptors:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(fd)
    return found


def connections_opened_by(make, store_port: int = -1):
    """(make(), the inodes of the TCP connections this process opened while it ran),
    leaving out those to `store_port`: another thread connecting to the store then."""
    before = open_sockets()
    made = make()
    opened = set()
    for inode, fd in open_sockets().items():
        if inode in before:
            continue
        try:
            with _socket_of(fd) as twin:
                peer = twin.getpeername()  # a listener has none
                if (twin.family in (socket.AF_INET, socket.AF_INET6)
                        and twin.type == socket.SOCK_STREAM and peer[1] != store_port):
                    opened.add(inode)
        except OSError:
            continue
    return made, opened


def _socket_of(fd: int) -> socket.socket:
    """A socket object on a duplicate of `fd`: the same connection, a descriptor of its
    own to close. OSError if `fd` is no longer a socket (the duplicate is closed then)."""
    duplicate = os.dup(fd)
    try:
        return socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        raise


def shut_down_sockets(inodes: Set[int]) -> None:
    """shutdown(2) the sockets with these inodes, where still open: the peer reads the
    end of the stream at once; the descriptor stays open for its owner to close."""
    for inode, fd in open_sockets().items():
        if inode not in inodes:
            continue
        try:
            with _socket_of(fd) as twin:
                if os.fstat(twin.fileno()).st_ino == inode:  # not a number reused since
                    twin.shutdown(socket.SHUT_RDWR)
        except OSError:  # gone in between
            pass


class _TorchHandle(Handle):
    def __init__(self, work, what: str, timeout: timedelta):
        self.work, self.what, self.timeout = work, what, timeout

    def wait(self) -> None:
        try:
            self.work.wait(self.timeout)
        except RuntimeError as error:
            raise _peer_error(self.what, error, self.timeout) from error

    def test(self) -> bool:
        return self.work.is_completed()


# Duplicates take their names from a range of torch's group counter that torch's own
# groups never reach (see _members_only_group); how many this rank has made, by ranks.
_DUPLICATE_NAMES_FROM = 1 << 48
_duplicates_made: Dict[Tuple[int, ...], int] = {}


def _members_only_group(ranks: List[int], backend: str, timeout: timedelta):
    """A new torch group over `ranks` (global ranks), made by those ranks alone,
    that leaves torch's naming of every later group as it was.

    torch names each group from a counter, `_world.group_count` (torch 2.14,
    distributed_c10d.py: `_process_group_name`), and finds the group's peers in the
    store under that name. `dist.new_group(ranks)` must be entered by every rank of
    the job, members or not, so every counter moves together. Duplicating a subgroup
    is collective over its members only, and the other ranks are never told: with
    `use_local_synchronization=True` they would not enter anyway, but the members'
    counters would move and theirs not. The next group the whole job makes would
    then have one name on the members and another on the rest, and would never form
    (each side waits in the store for the other until the timeout).

    So, for this one call, the counter is set to a value of a range of its own, the
    ranks and how many duplicates of them this rank made before (the same count on
    every member: duplicating is collective over them, in the same order), and then
    put back. The group's name (a hash of the ranks and that value) is unique, and
    the counter is the same on every rank of the job afterwards as before.

    A default group bound to a device (`init_process_group(..., device_id=...)`, which
    starts NCCL at once) makes torch split every new NCCL group from it, a call every
    rank of the job must make, members or not: a members-only group would wait for
    the others forever. For this call the binding is lifted too, so the group's NCCL
    starts on its own, among its members, on first use.
    """
    members = tuple(ranks)
    made = _duplicates_made[members] = _duplicates_made.get(members, 0) + 1
    world = dist.distributed_c10d._world
    default = dist.distributed_c10d._get_default_group()
    counter, bound = world.group_count, default.bound_device_id
    world.group_count = _DUPLICATE_NAMES_FROM + made
    default.bound_device_id = None
    try:
        return dist.new_group(list(members), backend=backend, timeout=timeout,
                              use_local_synchronization=True)
    finally:
        world.group_count = counter
        default.bound_device_id = bound


class TorchDistTransport(Transport):
    """Point-to-point over an already initialised torch.distributed process group."""

    def __init__(self, backend: str, rank: int, world_size: int, local_rank: int,
                 device: torch.device, timeout: timedelta, group=None,
                 owns_group: bool = True, store=None, cpu_group=None):
        super().__init__(rank, world_size, local_rank, device, timeout)
        self.backend = backend
        self.device_tensors_ok = backend == "nccl"
        self.step_by_step = backend == "nccl"  # see the module's notes
        self.group = group  # None: the default process group
        # The object whose methods move the bytes (see `pg`): the group's own, or
        # (over_store) a gloo instance of ours that torch.distributed does not know.
        self._pg = group
        # nccl: where CPU tensors go when the group has no CPU backend of its own
        self.cpu_group = cpu_group
        self.store = store  # set only for a gloo instance of ours: duplicates come from it
        self.duplicates = 0
        # over_store: the inodes of the group's TCP connections, and of its duplicates'
        # (a set shared by a group and every duplicate made from it): abort() ends them
        self.sockets: Set[int] = set()
        # nccl's batch_isend_irecv addresses peers by their rank in the default group
        self.global_ranks = (list(range(world_size)) if group is None or store is not None
                             else dist.get_process_group_ranks(group))
        # A group the user's script made (adopted, see world.adopt_torch_group) is
        # theirs to destroy; one made by init() is ours.
        self.owns_group = owns_group

    @property
    def pg(self):
        """The process group object itself. The default group is looked up on each use,
        never held: a reference kept past destroy_process_group() would let it be
        destroyed only during the interpreter's teardown, and abort the process."""
        return self._pg if self._pg is not None else dist.distributed_c10d._get_default_group()

    @property
    def cpu_pg(self):
        """The group CPU tensors go to: gloo (the group's own CPU part, or cpu_group)."""
        return self.cpu_group if self.cpu_group is not None else self.pg

    def _over_nccl(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (as moved: staged already) goes to NCCL; else to gloo."""
        return self.backend == "nccl" and tensor.device.type != "cpu"

    def _group_for(self, tensor: torch.Tensor):
        """The group object whose collectives move `tensor`: NCCL's, or gloo's."""
        return self.pg if self._over_nccl(tensor) else self.cpu_pg

    @classmethod
    def over_store(cls, store, rank: int, world_size: int, local_rank: int,
                   timeout: timedelta, prefix: str = "collectives") -> "TorchDistTransport":
        """gloo on an instance of our own, built from a torch.distributed store (every
        rank of the group calls this with the same store and prefix)."""
        gloo, connections = connections_opened_by(
            lambda: dist.ProcessGroupGloo(dist.PrefixStore(prefix + "/", store), rank,
                                          world_size, timeout),
            store_port=getattr(store, "port", -1))
        transport = cls("gloo", rank, world_size, local_rank, torch.device("cpu"), timeout,
                        group=gloo, owns_group=False, store=store)
        transport.prefix = prefix
        transport.sockets = connections  # gloo connects every pair as it is made
        return transport

    # --- point to point ---------------------------------------------------------------
    def _p2p(self, kind, tensor: torch.Tensor, peer: int) -> "dist.P2POp":
        return dist.P2POp(kind, tensor, self.global_ranks[peer], group=self.group)

    def _isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        what = f"send to rank {dst}"
        if self._over_nccl(tensor):  # a group of its own: see step_by_step
            work = dist.batch_isend_irecv([self._p2p(dist.isend, tensor, dst)])[0]
        else:
            try:
                work = self.cpu_pg.send([tensor], dst, 0)
            except RuntimeError as error:  # gloo: the connection is already closed
                raise _peer_error(what, error, self.timeout) from error
        return _TorchHandle(work, what, self.timeout)

    def _irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        what = f"receive from rank {src}"
        if self._over_nccl(tensor):
            work = dist.batch_isend_irecv([self._p2p(dist.irecv, tensor, src)])[0]
        else:
            try:
                work = self.cpu_pg.recv([tensor], src, 0)
            except RuntimeError as error:  # gloo: the connection is already closed
                raise _peer_error(what, error, self.timeout) from error
        return _TorchHandle(work, what, self.timeout)

    def exchange(self, sends, receives) -> None:
        """One step (base.Transport.exchange). On nccl the step's GPU sends and receives
        are one NCCL group (one batch_isend_irecv), so that no rank's step waits behind
        a posting its peer has not reached; CPU tensors go to gloo one by one."""
        if self.backend != "nccl":
            return super().exchange(sends, receives)
        moved_out = [(self._outgoing(tensor, dst, "exchange"), dst) for tensor, dst in sends]
        moved_in = [(self._incoming(tensor, src, "exchange"), src) for tensor, src in receives]
        group_ops = ([self._p2p(dist.irecv, t, src) for t, src in moved_in if self._over_nccl(t)]
                     + [self._p2p(dist.isend, t, dst) for t, dst in moved_out
                        if self._over_nccl(t)])
        handles = [self._irecv(t, src) for t, src in moved_in if not self._over_nccl(t)]
        handles += [self._isend(t, dst) for t, dst in moved_out if not self._over_nccl(t)]
        if group_ops:
            what = f"exchange with ranks {sorted({op.peer for op in group_ops})}"
            try:
                works = dist.batch_isend_irecv(group_ops)
            except RuntimeError as error:  # NCCL refused to post it: the peers will wait
                raise _peer_error(what, error, self.timeout) from error
            handles += [_TorchHandle(work, what, self.timeout) for work in works]
        for handle in handles:
            handle.wait()
        for (buffer, _), (tensor, _) in zip(moved_in, receives):
            if buffer is not tensor:  # staged
                tensor.copy_(buffer)

    def barrier(self) -> None:
        options = dist.BarrierOptions()
        if self.backend == "nccl":  # on gloo: NCCL's barrier would have to guess the GPU
            options.device = torch.device("cpu")
        _TorchHandle(self.cpu_pg.barrier(options), "barrier", self.timeout).wait()

    # --- the backend's own collectives -------------------------------------------------
    def _all_reduce_work(self, tensor: torch.Tensor, op):
        options = dist.AllreduceOptions()
        options.reduceOp = op
        return self._group_for(tensor).allreduce([tensor], options)

    def _reduce(self, tensor: torch.Tensor, op) -> None:
        _TorchHandle(self._all_reduce_work(tensor, op), "native all_reduce",
                     self.timeout).wait()

    def _native_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        nccl = self._over_nccl(tensor)
        if tensor.dtype == torch.int16 or (tensor.dtype == torch.bool and not nccl):
            # Neither has int16 reductions (gloo: "Invalid scalar type"; NCCL: "Short"),
            # gloo no bool. In int32 and back, every op gives the narrow type's own
            # answer: sums and products wrap alike, min/max and the bitwise ops are
            # exact on the sign-extended values (bool: sum and max are its or).
            wide = tensor.to(torch.int32)
            self._native_all_reduce(wide, "max" if tensor.dtype == torch.bool and op == "sum"
                                    else op)
            tensor.copy_(wide)
            return
        if tensor.is_complex() and op in ("sum", "avg"):  # the real and imaginary parts
            return self._native_all_reduce(torch.view_as_real(tensor), op)
        if nccl and op in _BITWISE_BY_BIT:
            return self._bitwise_by_bit(tensor, op)
        if nccl and tensor.dtype not in _NCCL_DTYPES:
            raise ValueError(f"native all_reduce: NCCL cannot reduce {tensor.dtype} "
                             f"(op {op}); use an algorithm built from point-to-point")
        if op == "avg" and nccl and tensor.is_floating_point():
            return self._reduce(tensor, dist.ReduceOp.AVG)
        self._reduce(tensor, _TORCH_OPS["sum" if op == "avg" else op])
        if op == "avg":  # gloo has no AVG: sum, then divide (floor for integers)
            if tensor.is_floating_point():
                tensor.div_(self.world_size)
            else:
                tensor.floor_divide_(self.world_size)

    def _bitwise_by_bit(self, tensor: torch.Tensor, op: str) -> None:
        """band, bor or bxor on NCCL, which has none: every bit of the tensor's bytes
        spread to a byte of its own, reduced by MIN (and), MAX (or) or SUM (xor: the
        sum's lowest bit, right modulo 256 too), and packed back. Exact, at 8 times
        the bytes."""
        data = tensor.reshape(-1).view(torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
        bits = ((data.unsqueeze(-1) >> shifts) & 1).contiguous()
        self._reduce(bits, _BITWISE_BY_BIT[op])
        if op == "bxor":
            bits &= 1
        data.copy_((bits << shifts).sum(-1).to(torch.uint8))

    def _native_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        nccl = self._over_nccl(tensor)
        if tensor.dtype not in (_NCCL_DTYPES if nccl else _GLOO_DTYPES):
            # a broadcast copies bytes: any dtype will do
            tensor = tensor.reshape(-1).view(torch.uint8)
        options = dist.BroadcastOptions()
        options.rootRank = src
        work = self._group_for(tensor).broadcast([tensor], options)
        _TorchHandle(work, f"native broadcast from rank {src}", self.timeout).wait()

    # --- duplicates and the end -----------------------------------------------------------
    def _duplicate(self) -> "TorchDistTransport":
        if self.store is not None:  # a gloo instance of ours: another one beside it
            self.duplicates += 1
            twin = self.over_store(self.store, self.rank, self.world_size, self.local_rank,
                                   self.timeout, f"{self.prefix}/dup{self.duplicates}")
            self.sockets.update(twin.sockets)
            twin.sockets = self.sockets  # the family's: an abort of either ends all
            return twin
        backend = str(dist.get_backend(self.pg)) if self.backend == "nccl" else self.backend
        group = _members_only_group(self.global_ranks, backend, self.timeout)
        cpu_group = (None if self.cpu_group is None else
                     _members_only_group(self.global_ranks, "gloo", self.timeout))
        return TorchDistTransport(self.backend, self.rank, self.world_size, self.local_rank,
                                  self.device, self.timeout, group, owns_group=False,
                                  cpu_group=cpu_group)

    def abort(self) -> None:
        """A gloo instance of ours (and its duplicates): end its connections now, so that
        a peer blocked on one of them fails at once instead of at its timeout, even while
        something here still holds the group (a pending receive does). gloo closes them
        only when the group is freed: its abort() and shutdown() leave them open
        (measured, torch 2.14), so the sockets it opened are shut down here. (With
        TORCH_GLOO_LAZY_INIT=1 gloo connects later, and none are known: peers then
        wait for their timeout.) A group of ours with NCCL: its communicators are
        aborted (ncclCommAbort), which ends what is in flight on them. Any other
        group: close()."""
        if self.store is not None:
            shut_down_sockets(self.sockets)
        elif self.backend == "nccl" and self.owns_group and dist.is_initialized():
            abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort_group is not None:
                try:
                    abort_group()
                except RuntimeError:
                    pass  # aborted already
        self.close()

    def close(self) -> None:
        if self.store is not None:
            self._pg = self.group = None  # a gloo instance of ours: let it go now
            return
        if self.group is not None or not self.owns_group:
            return  # a duplicate (its group goes with the default one), or the user's
        if dist.is_initialized():
            dist.destroy_process_group()
