"""Scheduling policy and KV block accounting: pure Python, shared by `engine` and `sim`."""

from bubblesim.core.policy.blocks import BlockManager
from bubblesim.core.policy.scheduler import Entry, ScheduledBatch, Scheduler, SchedulerConfig

__all__ = ["BlockManager", "Entry", "ScheduledBatch", "Scheduler", "SchedulerConfig"]
