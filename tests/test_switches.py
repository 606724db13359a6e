"""The seed-switch registry (bubblesim.core.switches) and Config.depth: the registry covers every
switch the
cost terms, the what-if and the ablation act on, and its "when can it act" rule is the one all
three apply."""

import itertools

import pytest

from bubblesim.core.config import SPEC_METHODS, Config
from bubblesim.core.switches import AFTER, BEFORE, BY_KEY, BY_NAME, SWITCHES, cannot_act, value_of
from replay.gpu import ablate
from sim import whatif
from sim.cost.terms import active_terms


def _grid() -> list[Config]:
    """Configs over every condition a switch depends on, each switch on either side."""
    out = []
    keys = [s.key for s in SWITCHES if s.key != "spec.method"]
    for method, bif, graphs in itertools.product(SPEC_METHODS, (1, 2, 3), (False, True)):
        for sides in itertools.product((False, True), repeat=len(keys)):
            over = dict(zip(keys, sides))
            if over["cuda_graphs_mixed"] and not graphs:
                continue  # refused by Config.validate
            over |= {"spec.method": method, "batches_in_flight": bif, "cuda_graphs": graphs}
            out.append(Config().replace(**over))
    return out


GRID = _grid()


def test_depth_is_one_with_ngram_cpu_else_batches_in_flight():
    for method, bif in itertools.product(SPEC_METHODS, (1, 2, 3)):
        c = Config().replace(**{"spec.method": method, "batches_in_flight": bif})
        assert c.depth == (1 if method == "ngram-cpu" else bif)
    assert "depth" not in Config().flat()  # derived, never a config key of its own


def test_every_switch_names_a_config_key_and_both_sides_are_valid():
    flat = Config().flat()
    for sw in SWITCHES:
        assert sw.key in flat, sw.name
        for side in (BEFORE, AFTER):
            c = Config().replace(cuda_graphs=True, **{sw.key: sw.value(side)})
            assert value_of(c, sw.key) == sw.value(side)
        assert sw.before != sw.after
    assert {s.seed for s in SWITCHES if s.seed is not None} == {1, 2, 3, 4, 5}
    with pytest.raises(ValueError, match="side"):
        SWITCHES[0].value("on")


def test_every_config_key_that_selects_a_term_is_a_registry_switch():
    """Flip each bool key (and spec.method) of the grid's configs: whatever changes the active
    terms is a registry switch; the depth (batches_in_flight) is the needs_async condition."""
    flat = Config().flat()
    probes = [k for k, v in flat.items() if isinstance(v, bool)] + ["spec.method"]
    selecting = set()
    for c, key in itertools.product(GRID[::7], probes):
        now = value_of(c, key)
        others = [not now] if isinstance(now, bool) else [m for m in SPEC_METHODS if m != now]
        for v in others:
            try:
                flipped = c.replace(**{key: v})
            except ValueError:  # cuda_graphs off under cuda_graphs_mixed
                continue
            if active_terms(flipped) != active_terms(c):
                selecting.add(key)
    seed_keys = {s.key for s in SWITCHES if s.seed is not None}
    assert selecting == seed_keys


def test_a_switch_that_cannot_act_selects_no_other_term():
    """On the grid, a seed switch moved from before to after changes the active terms exactly
    when it can act (judged on its before side, as the ablation does)."""
    for c, sw in itertools.product(GRID, [s for s in SWITCHES if s.seed is not None]):
        before = c.replace(**{sw.key: sw.before})
        after = c.replace(**{sw.key: sw.after})
        acts = cannot_act(sw, before) is None
        assert (active_terms(before) != active_terms(after)) == acts, (sw.name, c.flat())


def test_whatif_variants_are_the_registry_switches_plus_depth_spec_sampling_gc_and_host():
    names = set(whatif.VARIANT_NAMES)
    own = {f"batches_in_flight={n}" for n in (1, 2, 3)} | {f"spec.method={m}" for m in SPEC_METHODS}
    own |= {f"sampling={m}" for m in ("greedy", "random", "top_k", "top_p")}
    own |= {"gc_freeze", "gc.model", "host_scale=0.5", "host_scale=1.5"}
    assert names - own == set(BY_NAME)
    for c in GRID[::5]:
        for v in whatif.VARIANTS:
            if v.name in BY_NAME:
                for history in (False, True):
                    assert v.inert(c, history) == cannot_act(BY_NAME[v.name], c, history)


def test_whatif_moves_a_switch_to_its_other_side_or_leaves_it():
    by_name = {v.name: v for v in whatif.VARIANTS}
    for c in GRID[::5]:
        for sw in SWITCHES:
            over = by_name[sw.name].overrides(c)
            now = value_of(c, sw.key)
            if now in (sw.before, sw.after):
                assert over == {sw.key: sw.after if now == sw.before else sw.before}
            else:  # seed 4 under spec.method=none
                assert over == {} and cannot_act(sw, c) is not None


def test_ablate_switches_and_skips_come_from_the_registry():
    seeds = ["preallocated_backup_tokens", "accepted_count_by_sum", "reverse_placeholder_scan"]
    seeds += ["spec.method", "optimistic_spec_decode"]
    assert list(ablate.SWITCHES) == seeds  # the default --switches, in seed order
    assert ablate.values("spec.method") == ("ngram-cpu", "ngram-gpu")
    for sw in SWITCHES:
        assert sw.key in ablate.SWITCHES or sw.key in ablate.EXTRA_BOOL_SWITCHES
        assert ablate.values(sw.key) == (sw.before, sw.after)
    plain = Config()  # spec.method=none, 2 batches in flight
    assert ablate.skip_reason(plain, "spec.method") is None  # seed 4 turns spec decoding on
    assert "speculative" in (ablate.skip_reason(plain, "accepted_count_by_sum") or "")
    assert ablate.skip_reason(plain, "cuda_graphs_mixed") is None
    assert ablate.skip_reason(plain, "gc_freeze") is None  # not a registry switch
    sync = plain.replace(**{"spec.method": "ngram-gpu", "batches_in_flight": 1})
    assert "async" in (ablate.skip_reason(sync, "optimistic_spec_decode") or "")
    cpu = plain.replace(**{"spec.method": "ngram-cpu"})  # synchronous whatever the depth
    assert "async" in (ablate.skip_reason(cpu, "optimistic_spec_decode") or "")
    assert "eager" in (ablate.skip_reason(cpu, "cuda_graphs_mixed") or "")
    no_graphs = plain.replace(cuda_graphs=False)
    assert "cuda_graphs" in (ablate.skip_reason(no_graphs, "cuda_graphs_mixed") or "")
    assert set(BY_KEY) <= {*ablate.SWITCHES, *ablate.EXTRA_BOOL_SWITCHES}


def test_seed_terms_under_named_configs():
    """The terms each side pays, pinned on a few configs (independent of the registry's rule)."""
    gpu2 = Config().replace(**{"spec.method": "ngram-gpu", "batches_in_flight": 2})
    assert {"prepare_inputs.optimistic_fix", "draft.ngram_gpu_launch"} <= set(active_terms(gpu2))
    assert {"sample.accept_count_sum", "draft.backup_tokens_prealloc"} <= set(active_terms(gpu2))
    for sync in (gpu2.replace(batches_in_flight=1), gpu2.replace(**{"spec.method": "ngram-cpu"})):
        assert "prepare_inputs.optimistic_fix" not in active_terms(sync)
        assert "gpu.optimistic_fix" not in active_terms(sync)
    assert "draft.ngram_cpu" in active_terms(gpu2.replace(**{"spec.method": "ngram-cpu"}))
    plain = Config()  # no spec decoding: only seed 3's scan is paid
    assert active_terms(plain) == ("sample.reverse_placeholder_scan",)
    before = plain.replace(reverse_placeholder_scan=False, accepted_count_by_sum=False)
    assert active_terms(before) == ("sample.forward_placeholder_scan",)
