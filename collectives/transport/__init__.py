"""Transports: the only layer that knows which backend moves the bytes."""
from .base import CallMismatch, Handle, PeerError, Traffic, Transport, REDUCE_OPS
from .local import LocalTransport
from .shm import ShmTransport

__all__ = ["CallMismatch", "Handle", "PeerError", "Traffic", "Transport", "LocalTransport",
           "ShmTransport", "REDUCE_OPS"]
