"""Scheduling policy and KV block accounting: pure Python, shared by `engine` and `sim`."""

from core.policy.blocks import BlockManager
from core.policy.scheduler import Entry, ScheduledBatch, Scheduler, SchedulerConfig

__all__ = ["BlockManager", "Entry", "ScheduledBatch", "Scheduler", "SchedulerConfig"]
