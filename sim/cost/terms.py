"""Seed and speculative-decoding cost terms: which apply under a config, and where they land.

A term is named `<target>.<what>`: target is a CPU phase (`bubblesim.core.phases.CPU_PHASES`) or
`gpu`
(added to every GPU pass). Each term is a linear model in the profile's `terms` section (and,
for allocations, `alloc_terms`); `active_terms(config)` picks the ones the config's switches
select, so one profile serves both sides of every what-if.
"""

from __future__ import annotations

from collections.abc import Callable

from bubblesim.core.config import Config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.switches import AFTER, BEFORE, acts_on_side

GPU_TARGET = "gpu"
BROADCAST_TERM = "launch.tp_broadcast"  # bubblesim.core.phases.BROADCAST's cost, charged to launch


def optimistic_active(c: Config) -> bool:
    """Seed 5 runs only with drafts and async scheduling (with 1 batch in flight there is no
    next step to prepare optimistically; ngram-cpu runs synchronously whatever the depth)."""
    return acts_on_side(c, "optimistic_spec_decode", AFTER)


def _side(name: str, side: str) -> Callable[[Config], bool]:
    """A term of one side of seed switch `name` (bubblesim.core.switches): the config is on that
    side and
    the switch can act under it."""
    return lambda c: acts_on_side(c, name, side)


# name -> when it applies. Before/after pairs of one switch are listed together.
TERM_CONDITIONS: dict[str, Callable[[Config], bool]] = {
    "sample.forward_placeholder_scan": _side("reverse_placeholder_scan", BEFORE),  # seed 3
    "sample.reverse_placeholder_scan": _side("reverse_placeholder_scan", AFTER),
    "sample.accept_count_cat": _side("accepted_count_by_sum", BEFORE),  # seed 2
    "sample.accept_count_sum": _side("accepted_count_by_sum", AFTER),
    "draft.backup_tokens_list": _side("preallocated_backup_tokens", BEFORE),  # seed 1
    "draft.backup_tokens_prealloc": _side("preallocated_backup_tokens", AFTER),
    "draft.ngram_cpu": _side("ngram_proposer", BEFORE),  # seed 4
    "draft.ngram_gpu_launch": _side("ngram_proposer", AFTER),
    "prepare_inputs.optimistic_fix": optimistic_active,  # seed 5
    "gpu.rejection_sample": lambda c: c.spec.enabled,
    "gpu.accept_count_cat": _side("accepted_count_by_sum", BEFORE),
    "gpu.accept_count_sum": _side("accepted_count_by_sum", AFTER),
    "gpu.optimistic_fix": optimistic_active,
    # rank 0 sends the step's inputs to the other ranks (bubblesim.core.phases.BROADCAST): time
    # between
    # prepare_inputs and the forward's issue, charged to `launch`
    BROADCAST_TERM: lambda c: c.tensor_parallel_size > 1,
}
TERM_NAMES: tuple[str, ...] = tuple(TERM_CONDITIONS)

for _name in TERM_NAMES:  # invariant: every term targets a CPU phase or the GPU
    assert _name.split(".")[0] in (*CPU_PHASES, GPU_TARGET), _name


def term_target(name: str) -> str:
    return name.split(".", 1)[0]


def active_terms(config: Config) -> tuple[str, ...]:
    """Names of the terms that apply under `config`, in table order."""
    return tuple(n for n in TERM_NAMES if TERM_CONDITIONS[n](config))
