"""The engine's switches in one table (the five seeds and `cuda_graphs_mixed`): for each, its
config key, its value before and after the change it models, and when it can act at all.

Read by the simulator's cost terms (`sim.cost.terms`: which side's term a config pays), the
what-if (`sim.whatif`: one variant per switch, and the note when it cannot act under the
baseline) and the ablation (`replay.gpu.ablate`: off = before, on = after, skipped when it cannot
act). A new switch is one row here plus the code path it selects; nothing else lists switches.

When a switch can act is a property of the config (and of the trace, for `needs_history`), the
same for the engine and the simulator: under a config where it cannot act both sides run the
same code, so measuring or predicting the flip is wasted work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bubblesim.core.config import Config

BEFORE, AFTER = "before", "after"


@dataclass(frozen=True)
class Switch:
    name: str  # the what-if variant's name
    key: str  # dotted config key (`Config.replace` form)
    before: Any  # the value before the change (ablation side "off")
    after: Any  # the value after it (ablation side "on"; the config default)
    what: str  # what the "after" side does
    seed: int | None = None  # the seed it models (None: not a seed, a what-if of this project)
    pr: int | None = None  # the upstream vLLM PR of the seed
    needs_spec: bool = False  # acts only with speculative decoding
    needs_async: bool = False  # acts only with more than one batch in flight (Config.depth > 1)
    needs_history: bool = False  # acts only on needs_history requests (a trace property)
    needs_graphs: bool = False  # acts only with cuda_graphs
    eager_under_spec: bool = False  # does nothing with speculative decoding (steps stay eager)

    @property
    def models(self) -> str:
        """`seed 1 (PR 41043)`, or `what` for a switch that is not a seed."""
        return f"seed {self.seed} (PR {self.pr})" if self.seed is not None else self.what

    def value(self, side: str) -> Any:
        if side not in (BEFORE, AFTER):
            raise ValueError(f"side must be {BEFORE!r} or {AFTER!r}, not {side!r}")
        return self.before if side == BEFORE else self.after


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "preallocated_backup_tokens",
        "preallocated_backup_tokens",
        False,
        True,
        "backup token ids written into a preallocated buffer",
        seed=1,
        pr=41043,
        needs_spec=True,
    ),
    Switch(
        "accepted_count_by_sum",
        "accepted_count_by_sum",
        False,
        True,
        "accepted-token counts by one sum over the accept mask",
        seed=2,
        pr=38372,
        needs_spec=True,
    ),
    Switch(
        "reverse_placeholder_scan",
        "reverse_placeholder_scan",
        False,
        True,
        "the placeholder scan of a needs_history request from the end of its tokens",
        seed=3,
        pr=42938,
        needs_history=True,
    ),
    Switch(
        "ngram_proposer",
        "spec.method",
        "ngram-cpu",
        "ngram-gpu",
        "the n-gram proposer on the GPU (ngram-cpu runs synchronously: Config.depth)",
        seed=4,
        pr=29184,
        needs_spec=True,
    ),
    Switch(
        "optimistic_spec_decode",
        "optimistic_spec_decode",
        False,
        True,
        "the next step prepared before the accepted counts reach the host",
        seed=5,
        pr=32951,
        needs_spec=True,
        needs_async=True,  # with one batch in flight there is no next step to prepare early
    ),
    Switch(
        "cuda_graphs_mixed",
        "cuda_graphs_mixed",
        False,
        True,
        "prefill/mixed steps as CUDA graphs (engine.mixed_graphs)",
        needs_graphs=True,
        eager_under_spec=True,
    ),
)
BY_NAME: dict[str, Switch] = {s.name: s for s in SWITCHES}
BY_KEY: dict[str, Switch] = {s.key: s for s in SWITCHES}
assert len(BY_NAME) == len(BY_KEY) == len(SWITCHES)  # invariant: one row per name and per key


def value_of(config: Config, key: str) -> Any:
    """The value of a dotted key (`spec.method`) in `config`."""
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def on_side(config: Config, switch: Switch, side: str) -> bool:
    """The config sets the switch to `side`'s value."""
    return bool(value_of(config, switch.key) == switch.value(side))


def cannot_act(switch: Switch, config: Config, history: bool | None = None) -> str | None:
    """Why the switch has no effect under `config` (None: it can act). `history`: whether the
    trace has needs_history requests; None = unknown, not checked. Reasons in a fixed order, the
    first that holds is given."""
    if switch.needs_spec and not config.spec.enabled:
        return "needs speculative decoding (spec.method=none)"
    if switch.needs_async and config.depth == 1:
        return "needs async scheduling (batches_in_flight=1 or ngram-cpu runs synchronously)"
    if switch.needs_history and history is False:
        return "the trace has no needs_history requests (no placeholder scan)"
    if switch.needs_graphs and not config.cuda_graphs:
        return "cuda_graphs is off: there are no graphs to extend"
    if switch.eager_under_spec and config.spec.enabled:
        return "no effect with speculative decoding (its mixed steps stay eager)"
    return None


def acts_on_side(config: Config, name: str, side: str) -> bool:
    """The config is on `side` of switch `name` and the switch can act under it (trace history
    not checked): the condition of that side's cost terms."""
    sw = BY_NAME[name]
    return on_side(config, sw, side) and cannot_act(sw, config) is None
