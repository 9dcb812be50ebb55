"""What a peer is: another library's code for one of our sync strategies, driven like ours.

A peer is the reference a strategy of ours is compared with: torch's DDP and comm
hooks (trainer/torch_peers.py), torchft's DiLoCo (trainer/torchft_peer.py). It has
the moments of our SyncStrategy (collectives/sync/base.py: after_backward,
after_step, settle, close, state_dict, load_state_dict), so that the trainer's loop
and trainer.bench drive both alike, and what only a peer has:

    wrap(model)        the peer's own module around the model (torch's DDP, or the
                       model as it is), in place of our DDP
    traffic            the counter of our transport that carries its collectives
                       (ddp-collectives); None where only the kernel sees its bytes
                       (gloo's peers: trainer/timing.py counts their sockets)
    bucket_intervals   when each bucket's communication ran, from wrap(observed=True)

This class holds what every peer shares; each peer's file holds the rest. Peers are
made by name in trainer/torch_peers.py (`create`, `is_peer`, `NAMES`), the one place
that knows them all.
"""
from __future__ import annotations

import torch


class Peer:
    """A peer as the trainer sees it (see the module docstring)."""

    uses_buckets = True   # gradients reduced in buckets during backward (a DDP's)
    syncs_per_period = 1  # as our strategies say it (collectives/sync/base.py)

    def after_backward(self, model: torch.nn.Module) -> None:
        """Nothing: a peer's DDP has finished its reduction inside backward(), and a
        peer without one communicates after steps."""
