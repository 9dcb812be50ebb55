"""Sync strategies, one file each, registered by name. See base.py for the interface."""
from .base import SyncStrategy, available, create, register
from . import allreduce  # noqa: F401  (registers "allreduce")

__all__ = ["SyncStrategy", "available", "create", "register"]
