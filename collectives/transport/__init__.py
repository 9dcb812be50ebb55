"""Transports: the only layer that knows which backend moves the bytes."""
from .base import Handle, PeerError, Traffic, Transport, REDUCE_OPS
from .local import LocalTransport
from .shm import ShmTransport

__all__ = ["Handle", "PeerError", "Traffic", "Transport", "LocalTransport", "ShmTransport",
           "REDUCE_OPS"]
