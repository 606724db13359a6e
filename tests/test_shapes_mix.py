"""The sweep's opt-in decode(mix) families: decode batches whose contexts spread around a mean,
each with its uniform control at the same rows and KV (how much of the decode tail term each
graph bucket hides: reports/fidelity/README.md section I)."""

from __future__ import annotations

from collections import defaultdict

from replay.analysis.shapes_grid import (
    MIX_FAMILIES,
    MIX_MEANS,
    MIX_SPREADS,
    Limits,
    batch_shape,
    grid,
    mix_contexts,
)

LIM = Limits(max_tokens=8192, max_seqs=256, max_len=131072, kv_tokens=20000 * 16)


def test_mix_contexts_keep_the_mean_and_spread_evenly():
    for rows in (8, 64, 256):
        for mean in MIX_MEANS:
            for s in MIX_SPREADS:
                ctx = mix_contexts(rows, mean, s)
                assert len(ctx) == rows and abs(sum(ctx) / rows - mean) <= 1
                half = mean * s / 100
                assert max(ctx) - min(ctx) == round(mean + half) - round(mean - half)
                assert mix_contexts(rows, mean, s) == ctx  # fixed order
    assert mix_contexts(64, 1024, 50) != sorted(mix_contexts(64, 1024, 50))  # shuffled


def test_every_spread_point_has_its_uniform_control_in_the_family():
    mix = [b for b in grid(LIM, mix=True) if b.label == "decode(mix)"]
    cells: dict[tuple[int, int], set[int]] = defaultdict(set)
    for b in mix:
        ax = dict(b.axes)
        assert len(b.entries) == ax["batch"] and all(not e.prefill and e.n == 1 for e in b.entries)
        shape = batch_shape(b.entries)
        assert abs(shape["kv_read_tokens"] / ax["batch"] - ax["mean"]) <= 1
        assert b.blocks(LIM.block_size) * LIM.block_size <= LIM.kv_tokens  # never wrapped
        cells[ax["batch"], ax["mean"]].add(ax["spread"])
    assert cells and all(s == set(MIX_SPREADS) for s in cells.values())
    # rows x mean within the 320k-token cache: the longest means stop at smaller batches
    assert (256, 1024) in cells and (256, 2048) not in cells and (64, 4096) in cells
    assert {b for b, _ in cells} == {b for b in LIM.decode_buckets() if b >= 8}


def test_longest_first_holds_the_same_rows_sorted():
    batches = grid(LIM, mix=True)
    shuffled = {b.axes: b for b in batches if b.label == "decode(mix)"}
    desc = [b for b in batches if b.label == "decode(mix desc)"]
    assert desc and all(dict(b.axes)["spread"] > 0 for b in desc)
    for b in desc:
        ctx = [e.seq_len for e in b.entries]
        assert ctx == sorted(ctx, reverse=True)
        assert sorted(ctx) == sorted(e.seq_len for e in shuffled[b.axes].entries)
    assert len(desc) == sum(dict(b.axes)["spread"] > 0 for b in shuffled.values())


def test_no_mix_with_drafts():
    spec = Limits(max_tokens=2048, max_seqs=64, max_len=4096, spec_k=3)
    assert not [b for b in grid(spec, mix=True) if b.label == "decode(mix)"]


def test_a_full_grid_leaves_them_out_and_a_plan_naming_them_has_them() -> None:
    from bubblesim.core.config import Config
    from replay.analysis.shapes_plan import plan

    assert not [b for b in grid(LIM) if b.label in MIX_FAMILIES]
    plain = [b for b in grid(LIM, mix=True) if b.label not in MIX_FAMILIES]
    assert plain == grid(LIM)  # the families add points and move none
    cfg = Config(model="llama3-8b")
    some = plan(cfg, 20000, budget_s=None, families=MIX_FAMILIES)
    assert {b.label for b in some.batches} == set(MIX_FAMILIES)
    assert not [b for b in plan(cfg, 20000, budget_s=None).batches if b.label in MIX_FAMILIES]
