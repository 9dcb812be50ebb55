"""gather and scatter: the root receives from (sends to) each rank in turn, after a word.

Their lists are the root's alone (gather's outputs, scatter's inputs), and only the
root can refuse them. So every gather and scatter begins with a word from the root to
each rank, one byte: whether the call goes on.

    root:    word GOES_ON to each rank   then receive (gather) or send (scatter) the pieces
    others:  hear the word               then send (gather) or receive (scatter) a piece

The others send their gather pieces only after the word: a root that refused, here or in
torch's own checks before the backend is called, leaves no message of theirs behind for
a later call to read (they used to send at once, and the root's next all-reduce read
them: 7 for 3 on both ranks, with no error). A root that refuses says REFUSED, and every
rank refuses too, in step (work.Refused): the group goes on.

A rank other than the root may refuse its own side (a scatter output whose elements
share memory). It still hears the word, where the call is in the group's sequence:
REFUSED, and nothing more is sent; GOES_ON, and a scatter's piece is received into
scratch memory and dropped, so the root's call completes and the group goes on. A
gather's piece it cannot give (its input was refused): the root then waits for it in
vain, and fails at the group's timeout, as gloo's does; this rank's group refuses every
later call, so that no later call of its own meets the root's.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..transport import Transport
from .tensors import bytes_view, packed, unpack
from .work import Refused

GOES_ON, REFUSED = 1, 0  # the root's first message of a gather or scatter


def root_says(comm: Transport, root: int, word: int, wait: bool = True):
    """The root's word to every other rank; with wait=False, the handles to wait on."""
    message = torch.tensor([word], dtype=torch.uint8)
    handles = [comm.isend(message, peer) for peer in range(comm.world_size) if peer != root]
    if not wait:
        return handles
    for handle in handles:
        handle.wait()
    return []


def hear_root(comm: Transport, root: int, collective: str, what: str) -> None:
    """The root's word, on another rank: raise Refused if the root refused its `what`."""
    word = torch.empty(1, dtype=torch.uint8)
    comm.recv(word, root)
    if word.item() != GOES_ON:
        raise Refused(f"{collective}: the root (rank {root}) refused its {what}; nothing "
                      "was sent")


def gather(comm: Transport, root: int, outputs: Optional[List[torch.Tensor]],
           input: torch.Tensor) -> None:
    """outputs[r] <- rank r's input, on the root (outputs: the root's list; None
    elsewhere)."""
    mine = bytes_view(packed(input))
    if comm.rank != root:
        hear_root(comm, root, "gather", "output lists")
        comm.send(mine, root)
        return
    buffers = [packed(t) for t in outputs]
    handles = [comm.irecv(bytes_view(buffers[peer]), peer)
               for peer in range(comm.world_size) if peer != root]
    handles += root_says(comm, root, GOES_ON, wait=False)
    bytes_view(buffers[root]).copy_(mine)
    for handle in handles:
        handle.wait()
    for buffer, output in zip(buffers, outputs):
        unpack(buffer, output)


def scatter(comm: Transport, root: int, output: torch.Tensor,
            inputs: Optional[List[torch.Tensor]]) -> None:
    """output <- the root's inputs[r], on rank r (inputs: the root's list; None
    elsewhere)."""
    buffer = packed(output)
    if comm.rank != root:
        hear_root(comm, root, "scatter", "input list")
        comm.recv(bytes_view(buffer), root)
    else:
        pieces = [bytes_view(packed(t)) for t in inputs]
        handles = root_says(comm, root, GOES_ON, wait=False)
        handles += [comm.isend(pieces[peer], peer) for peer in range(comm.world_size)
                    if peer != root]
        bytes_view(buffer).copy_(pieces[root])
        for handle in handles:
            handle.wait()
    unpack(buffer, output)


def refused_here(comm: Transport, root: int, collective: str,
                 receive_like: Optional[torch.Tensor] = None) -> None:
    """What a rank that refused its side of a gather or scatter does in the call's
    place: the root says REFUSED; another rank hears the word and, if the root went
    on, takes a scatter's piece into scratch like `receive_like` (None: it cannot,
    and raises, so that its group refuses the rest)."""
    if comm.rank == root:
        root_says(comm, root, REFUSED)
        return
    word = torch.empty(1, dtype=torch.uint8)
    comm.recv(word, root)
    if word.item() != GOES_ON:
        return
    if receive_like is None:
        raise RuntimeError(f"{collective}: this rank refused its side and the root "
                           f"(rank {root}) went on without it; the group cannot go on")
    comm.recv(bytes_view(torch.empty(receive_like.shape, dtype=receive_like.dtype)), root)
