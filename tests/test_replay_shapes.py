"""`replay shapes` (clean timings of synthetic batches) and `replay calibrate --shapes`.

The sweep runs on CPU with the tiny model (a synchronous forward, wall time); the calibration
tests use runs written here whose mixed steps are never clean (the GPU began them while the host
was still launching), as on llama3.2-1b, and sweep files whose times are a known linear function
of the shape, so the fit must give those coefficients back. The GPU test (skipped without CUDA)
runs a small sweep on the device and checks every sample was clean.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import sched_cfg

from bubblesim.core.cli import run_main
from bubblesim.core.config import Config
from bubblesim.core.policy import Scheduler
from bubblesim.core.request import Request
from bubblesim.core.runfmt import RunRecorder, write_run
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from replay.analysis.calibrate import GPU_TERMS, CalibrationError, calibrate, write_calibration
from replay.gpu.run import gpu_name
from replay.gpu.shapes import (
    COLUMNS,
    FORMAT_VERSION,
    META_KEY,
    Batch,
    Entry,
    Limits,
    Sample,
    batch_shape,
    grid,
    plan,
    read_sweeps,
    shape_row,
    sweep,
    write_sweep,
)

TRACE = {"path": "synthetic.parquet", "sha256": "cd" * 32, "rows": 0}
H100 = "NVIDIA H100 80GB HBM3"
# ms; the true GPU pass of the synthetic engine and of the synthetic sweeps
MIXED = {
    "intercept": 1.5,
    "num_tokens": 0.012,
    "kv_read_tokens": 3e-5,
    "attn_pairs": 2e-8,
    "num_reqs": 0.02,
    "num_prefill_reqs": 0.3,
}
DECODE = {"intercept": 0.9, "num_tokens": 0.005, "kv_read_tokens": 4e-5}
SWEEP_CFG = dict(max_num_batched_tokens=320, max_num_seqs=20, max_model_len=768)


def _lin(model: dict[str, float], s: dict[str, int] | BatchShape) -> float:
    get = s.get if isinstance(s, dict) else lambda k: getattr(s, k)  # type: ignore[union-attr]
    out = 0.0
    for t, c in model.items():
        v = 1 if t == "intercept" else get("prefill_tokens") + get("decode_tokens")
        out += c * (v if t in ("intercept", "num_tokens") else get(t))
    return out


SWEEP_POINTS = 30


@pytest.fixture(scope="module")
def cpu_sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shapes") / "tiny.parquet"
    cfg = Config(model="tiny", device="cpu", **SWEEP_CFG)
    res = sweep(cfg, out, repeats=2, points=SWEEP_POINTS)
    assert res.path == out and res.complete
    return out


# ---- the sweep ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_sweep_writes_a_valid_file(cpu_sweep: Path):
    table = pq.read_table(cpu_sweep)
    assert tuple(table.column_names) == COLUMNS
    meta = json.loads(table.schema.metadata[META_KEY])
    cfg = Config(model="tiny", device="cpu", **SWEEP_CFG)
    assert meta["format"] == "replay.shapes" and meta["version"] == FORMAT_VERSION
    assert meta["measures"] == "step" and "gpu_begin" in meta["timed"]
    assert (meta["model"], meta["dtype"], meta["gpu"]) == ("tiny", "bfloat16", gpu_name(cfg))
    assert meta["torch"] == torch.__version__ and meta["date"][:4].isdigit()
    assert meta["config"]["max_num_batched_tokens"] == 320 and "engine_commit" in meta
    assert meta["dropped_shapes"] == 0 and meta["kv_wrapped_shapes"] == 0
    d = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    n = len(table)
    assert n == meta["shapes"] == SWEEP_POINTS == meta["grid"]["selected_shapes"]
    assert meta["grid"]["grid_shapes"] > SWEEP_POINTS and meta["grid"]["repeats"] == 2
    kinds = d["kind"].astype(str)
    assert set(kinds) == {"decode", "mixed"}
    assert ((kinds == "decode") == (d["num_prefill_reqs"] == 0)).all()
    tokens = d["prefill_tokens"] + d["decode_tokens"]
    assert (tokens <= 320).all() and (d["num_reqs"] <= 20).all() and (d["num_reqs"] >= 1).all()
    assert (d["max_kv_tokens"] <= 767).all() and (d["max_seq_len"] == d["max_kv_tokens"]).all()
    assert (d["kv_read_tokens"] >= tokens).all() and (d["attn_pairs"] >= tokens).all()
    assert (d["context_tokens"] == d["kv_read_tokens"]).all()
    assert (d["decode_tokens"] == d["num_reqs"] - d["num_prefill_reqs"]).all()
    assert (d["new_reqs"] <= d["num_prefill_reqs"]).all() and (d["draft_tokens"] == 0).all()
    assert (d["gpu_ms"] > 0).all() and (d["repeats"] == 2).all() and (d["unclean"] == 0).all()
    assert (d["gpu_ms_min"] <= d["gpu_ms"]).all() and (d["gpu_ms"] <= d["gpu_ms_max"]).all()
    assert not d["graph"].any() and (d["spin_ms"] == 0).all()  # CPU: eager, no spin
    assert (np.diff(d["level"]) >= 0).all() and d["level"][0] == 0  # corners first
    fresh = np.flatnonzero(d["label"] == "prefill")  # one fresh chunk of P: P (P + 1) / 2 pairs
    p = d["prefill_tokens"][fresh]
    assert len(fresh) and (d["attn_pairs"][fresh] == p * (p + 1) // 2).all()
    later = np.flatnonzero(d["label"] == "prefill@ctx")
    assert len(later) and (d["new_reqs"][later] == 0).all()
    # each row's shape is the scheduler's, and the grid's view of it agrees
    pl = plan(cfg, meta["num_kv_blocks"], repeats=2, points=SWEEP_POINTS)
    for i, b in enumerate(pl.batches):
        assert {f: int(d[f][i]) for f in SHAPE_FIELDS} == batch_shape(b.entries), b
    # the envelope: corners of the config (batch 1 and max_num_seqs, contexts to the model
    # length, prefill chunks to the token budget)
    env = meta["envelope"]
    assert env["decode"]["num_reqs"] == [1, 20] and env["decode"]["kv_per_req"] == [64, 767]
    assert env["mixed"]["prefill_tokens"] == [16, 320]
    axes = meta["grid"]["axes"]
    assert axes["decode"]["batch"][0] == 1 and axes["decode"]["batch"][-1] == 20
    rows = read_sweeps([cpu_sweep])
    assert len(rows) == n and rows.decode.sum() == (kinds == "decode").sum()


def test_batch_shape_is_the_schedulers():
    """Synthetic batches get the BatchShape the scheduler would give the same entries: drive
    the real policy (whole prompts, no prefix cache, synchronous) and recompute each step."""
    sched = Scheduler(
        sched_cfg(max_num_seqs=6, max_num_batched_tokens=96, num_blocks=400, prefix_caching=False)
    )
    rng = random.Random(3)
    for i in range(14):
        sched.add(Request(i, f"r{i}", 0.0, rng.randint(2, 60), rng.randint(1, 12)))
    steps = 0
    while sched.has_unfinished:
        batch = sched.schedule()
        assert batch is not None
        mine = [Entry(e.start_pos, e.num_tokens, e.is_prefill) for e in batch.entries]
        got = batch_shape(mine)
        want = batch.shape.as_dict()
        if all(e.generates for e in batch.entries):  # a chunk that ends its prompt
            assert {f: got[f] for f in SHAPE_FIELDS} == want
        else:  # a partial chunk's request holds more prompt than it has computed
            assert {f: got[f] for f in SHAPE_FIELDS if f != "context_tokens"} == {
                f: v for f, v in want.items() if f != "context_tokens"
            }
        assert got["max_kv_tokens"] == max(e.start_pos + e.num_tokens for e in batch.entries)
        sched.complete(batch, [1] * len(batch.entries))
        steps += 1
    assert steps > 20


def _fits(b: Batch, lim: Limits) -> bool:
    ok = b.num_tokens <= lim.max_tokens and len(b.entries) <= lim.max_seqs
    for e in b.entries:
        room = 1 if e.prefill else e.drafts + 1  # the request keeps room for its outputs
        ok &= e.seq_len + room <= lim.max_len and e.seq_len <= lim.context_cap
        ok &= e.n == (e.n if e.prefill else 1 + e.drafts) and (e.n >= 2 or not e.prefill)
    return ok


def test_grid_respects_the_limits_covers_the_corners_and_is_deterministic():
    cache = Limits(8192, 256, 32768, kv_tokens=640_000)
    for lim in (
        cache,
        Limits(320, 20, 768),
        Limits(2048, 64, 4096, spec_k=3),
        Limits(8192, 256, 131072, max_context=65536),
    ):
        g = grid(lim)
        assert g == grid(lim) and len({b.entries for b in g}) == len(g)
        assert [b.level for b in g] == sorted(b.level for b in g)  # coarse points first
        bs = lim.block_size
        for b in g:
            assert _fits(b, lim), b
            wrapped = b.blocks(bs) * bs > lim.kv_tokens
            assert not wrapped or b.label == "decode", b  # only the table's bracket cells
        dec = [b for b in g if b.label == "decode"]
        top = lim.decode_buckets()[-1]
        corners = {(len(b.entries), b.max_seq_len) for b in dec if b.level == 0}
        cap = lim.decode_cap(lim.spec_k)
        assert {(1, 64), (1, cap), (top, 64)} <= corners, lim  # the table's corners
        pre = {b.num_tokens for b in g if b.label == "prefill" and b.level == 0}
        assert {16, min(lim.max_tokens, lim.prefill_cap)} <= pre
        assert all(
            len({e.drafts for e in b.entries if not e.prefill} - {lim.spec_k}) == 0
            for b in g
            if b.label in ("decode", "prefill+decode")
        )
    # the decode table: every bucket and the midpoints between them, sqrt-2 contexts
    dec = [b for b in grid(cache) if b.label == "decode"]
    sizes = sorted({len(b.entries) for b in dec})
    assert sizes[:8] == [1, 2, 3, 4, 6, 8, 12, 16] and 24 in sizes and 240 in sizes
    ctx = sorted({b.max_seq_len for b in dec})
    assert ctx[:4] == [64, 91, 128, 181] and ctx[-1] == 32767
    # the cache: each batch size's contexts stop at the first cell past the cache (wrapped)
    for b_size in (1, 64, 256):
        mine = sorted(b.max_seq_len for b in dec if len(b.entries) == b_size)
        over = [c for c in mine if b_size * (-(-c // 16)) * 16 > 640_000]
        assert len(over) <= 1 and (b_size == 1 or len(over) == 1)
    # speculative decoding: k drafts in the table (graphs), 0..k in `verify`
    spec = grid(Limits(2048, 64, 4096, spec_k=3))
    widths = {e.drafts for b in spec if b.label == "verify" for e in b.entries}
    assert widths == {0, 1, 2}  # k drafts: the decode table's points (kept once)
    assert {e.drafts for b in spec if b.label == "decode" for e in b.entries} == {3}
    assert any(len({e.drafts for e in b.entries}) > 1 for b in spec if b.label == "verify(widths)")
    # a prefix hit is a new request with prior context, a later chunk is not new
    full = grid(Limits(8192, 256, 131072))
    hits = [b for b in full if b.label == "prefill@hit"]
    assert hits and all(b.entries[0].start > 0 and b.entries[0].is_new for b in hits)
    assert {b.kind for b in grid(cache, ("mixed",))} == {"mixed"}


def test_the_plan_fits_the_budget_coarse_points_first():
    cfg = Config(model="llama3.2-1b", max_model_len=32768)
    whole = plan(cfg, 40_000, budget_s=None)
    assert 600 <= len(whole.batches) <= 1000 and whole.estimate_s < 240  # ~50 s of GPU
    cut = plan(cfg, 40_000, budget_s=10.0)
    assert cut.estimate_s <= 10.0 and 0 < len(cut.batches) < len(whole.batches)
    levels = [b.level for b in cut.batches]
    assert levels.count(0) + levels.count(1) > 0.5 * len(levels)
    some = plan(cfg, 40_000, points=25)
    assert [b.entries for b in some.batches] == [b.entries for b in whole.batches[:25]]
    assert {b.label for b in some.batches} >= {"decode", "prefill", "prefill+decode"}


def test_shapes_cli_and_a_cache_too_small(tmp_path: Path, capsys):
    from replay.__main__ import main

    out = tmp_path / "s.parquet"
    sets = ["--set", "model=tiny", "--set", "device=cpu", "--set", "num_kv_blocks=8"]
    sets += [f"--set={k}={v}" for k, v in SWEEP_CFG.items()]
    assert main(["shapes", *sets, "--repeats", "1", "-q", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"shapes -> {out}" in text and "wrapped KV blocks" in text
    planned = re.search(r"grid: (\d+) of \1 shapes, estimated GPU time", text)
    assert planned, text
    t = pq.read_table(out)
    meta = json.loads(t.schema.metadata[META_KEY])
    wrapped = t.column("kv_wrapped").to_numpy(zero_copy_only=False)
    assert meta["num_kv_blocks"] == 8 and wrapped.any()
    assert meta["kv_wrapped_shapes"] == int(wrapped.sum())
    assert (t.column("kv_blocks").to_numpy()[wrapped] > 8).all()
    assert (t.column("kv_blocks").to_numpy()[~wrapped] <= 8).all()
    assert meta["unstaged_shapes"] > 0  # a single request longer than the cache
    assert len(t) + meta["unstaged_shapes"] == int(planned.group(1)) == meta["shapes"]
    for bad, why in (
        (["--kinds", "prefill"], "--kinds"),
        (["--points", "0"], "--points"),
        (["--max-context", "-1"], "--max-context"),
    ):
        with pytest.raises(SystemExit) as e:
            run_main(main, ["shapes", *sets, *bad, "-o", str(tmp_path / "x.parquet")])
        assert e.value.code == 2 and why in capsys.readouterr().err
        assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("method", ["ngram-gpu", "ngram-cpu"])
def test_a_spec_sweep_times_verification_rows(tmp_path: Path, method: str):
    """Spec configs: decode rows verify k drafts (the table) or 0..k (verify families); the
    rows' shapes are the scheduler's (draft_tokens), every shape repeated cleanly."""
    cfg = Config(model="tiny", device="cpu", max_num_batched_tokens=128, max_num_seqs=8,
                 max_model_len=512).replace(**{"spec.method": method, "spec.k": 2})  # fmt: skip
    res = sweep(cfg, tmp_path / "s.parquet", repeats=2, points=30)
    assert res.complete and res.rows == 30 and res.dropped_shapes == 0
    t = pq.read_table(res.path)
    d = {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}
    dec = d["kind"].astype(str) == "decode"
    assert (d["spec_k"] == 2).all() and (d["draft_tokens"][dec] <= 2 * d["num_reqs"][dec]).all()
    labels = set(d["label"].astype(str))
    assert {"decode", "verify"} <= labels and (d["draft_tokens"] > 0).any()
    assert (d["decode_tokens"] == d["num_reqs"] - d["num_prefill_reqs"] + d["draft_tokens"]).all()


def test_a_cut_sweep_leaves_a_valid_partial_file(tmp_path: Path, monkeypatch):
    """SIGTERM after 3 shapes: the file holds the rows timed so far, complete false; the file
    is also rewritten while the sweep runs (here after every row)."""
    import os
    import signal

    import replay.gpu.shapes as shapes

    monkeypatch.setattr(shapes, "WRITE_EVERY_S", 0.0)
    out = tmp_path / "cut.parquet"
    seen: list[int] = []

    def progress(text: str) -> None:
        if out.exists():
            seen.append(len(pq.read_table(out)))
        if text.startswith("shape 4/"):
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = Config(model="tiny", device="cpu", **SWEEP_CFG)
    res = sweep(cfg, out, repeats=1, points=10, progress=progress)
    assert not res.complete and res.rows == 3 and seen == [1, 2, 3]
    cols, meta = shapes.read_sweep(out)
    assert len(cols["gpu_ms"]) == 3 and meta["complete"] is False
    assert meta["stopped"] == "SIGTERM" and meta["measures"] == "step"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ---- calibrate --shapes -------------------------------------------------------------------------
def eager_run(
    out: Path,
    seed: int,
    gpu: str = H100,
    cfg: Config | None = None,
    mixed_clean: bool = False,
    mixed_extra_ms: float = 0.0,
) -> Path:
    """A synchronous loop over random batches with the GPU pass of MIXED / DECODE. Decode
    steps are clean (the GPU starts after the host's last phase); mixed steps are clean only
    with `mixed_clean`, else the GPU starts during the launch (an eager launch slower than its
    kernels) and the interval is the launch's pace, not the kernels'."""
    rng = np.random.default_rng(seed)
    cfg = cfg or Config(model="tiny")
    rec = RunRecorder()
    rec.add_request("r0", 0.0)
    t = 0.0
    for _ in range(160):
        mixed = rng.random() < 0.3
        rows = [Entry(int(c) - 1, 1, False) for c in rng.integers(20, 3000, rng.integers(1, 24))]
        if mixed:
            rows.append(Entry(int(rng.integers(0, 2000)), int(rng.integers(16, 600)), True))
        s = BatchShape(**{f: v for f, v in batch_shape(rows).items() if f in SHAPE_FIELDS})
        k = rec.add_step(s)
        for ph, d in (("schedule", 0.1), ("prepare_inputs", 0.2)):
            rec.phase(k, ph, t, t + d / 1e3)
            t += d / 1e3
        launch = (8.0 if mixed else 0.05) / 1e3
        rec.phase(k, "launch", t, t + launch)
        g0 = t + 0.1e-3 if mixed and not mixed_clean else t + launch + 0.1e-3
        t += launch
        for ph in ("sample", "draft"):
            rec.phase(k, ph, t, t + 0.05e-3)
            t += 0.05e-3
        gpu_ms = _lin(MIXED, s) + mixed_extra_ms if mixed else _lin(DECODE, s)
        if mixed and not mixed_clean:
            gpu_ms += 6.0  # the kernels trickle in behind the launch
        g0 = max(g0, t) if not mixed or mixed_clean else g0
        rec.gpu(k, g0, g0 + gpu_ms / 1e3)
        t = max(t, g0 + gpu_ms / 1e3)
        rec.phase(k, "process_outputs", t, t + 0.05e-3)
        t += 0.05e-3
        rec.tokens(0, t)
    rec.finish(0, t)
    write_run(out, rec, config=cfg, trace=TRACE, source={"kind": "replay", "gpu": gpu})
    return out


def fake_sweep(
    path: Path,
    model: str = "tiny",
    gpu: str = H100,
    dtype: str = "bfloat16",
    decode_graph: bool = True,
) -> Path:
    """A sweep file of the real grid's shapes whose times are exactly MIXED / DECODE."""
    rows = []
    for b in grid(Limits(512, 64, 40000)):
        shape = batch_shape(b.entries)
        ms = _lin(MIXED if b.kind == "mixed" else DECODE, shape)
        bucket = len(b.entries) if decode_graph and b.kind == "decode" else 0
        rows.append(shape_row(b, [Sample(ms, 0.1, 0.2)], 0, bucket, b.max_seq_len, 1, False))
    meta = {"format": "replay.shapes", "version": FORMAT_VERSION, "model": model, "gpu": gpu}
    return write_sweep(path, rows, {**meta, "dtype": dtype})


def test_calibrate_fits_mixed_from_a_sweep_when_no_mixed_step_is_clean(tmp_path: Path):
    runs = [eager_run(tmp_path / f"r{i}", seed=i) for i in range(2)]
    alone = calibrate(runs)
    assert "mixed" not in alone.profile["gpu_pass"]
    assert any("gpu_pass.mixed: only 0 of" in n for n in alone.notes)
    f = fake_sweep(tmp_path / "s.parquet")
    default = calibrate(runs, shapes=[f])  # by default only mixed rows join
    assert default.quality["gpu_pass.decode.fitted_on"]["shape_rows"] == 0
    assert default.quality["gpu_pass.mixed.fitted_on"]["shape_rows"] > 0
    cal = calibrate(runs, shapes=[f], shapes_kinds=("decode", "mixed"))
    for kind, true in (("mixed", MIXED), ("decode", DECODE)):
        got = cal.profile["gpu_pass"][kind]
        for term in GPU_TERMS[kind]:
            assert got.get(term, 0.0) == pytest.approx(true.get(term, 0.0), rel=1e-6, abs=1e-12)
    q = cal.quality
    n_mixed = sum(1 for b in grid(Limits(512, 64, 40000)) if b.kind == "mixed")
    n_decode = sum(  # rows with history (penalties) fit gpu_pass.history alone
        1 for b in grid(Limits(512, 64, 40000)) if b.kind == "decode" and "history" not in b.label
    )
    mix = q["gpu_pass.mixed.fitted_on"]
    assert (mix["run_steps"], mix["shape_rows"]) == (0, n_mixed)
    dec = q["gpu_pass.decode.fitted_on"]
    assert dec["run_steps"] > 50 and dec["shape_rows"] == n_decode  # graph rows, graph runs
    assert q["gpu_pass.mixed.shapes"]["r2"] > 0.999999
    assert q["gpu_pass.decode.runs_vs_sweep"]["offset_ms"] == pytest.approx(0.0, abs=1e-9)
    assert "gpu_pass.mixed.runs_vs_sweep" not in q  # no clean mixed run step to compare
    assert "+ 1 shape sweep(s)" in cal.profile["notes"] and cal.shapes == [str(f)]
    side = write_calibration(cal, tmp_path / "p.json", {})
    rep = json.loads(side.read_text())
    assert rep["shapes"] == [str(f)] and rep["fit"]["gpu_pass.mixed.fitted_on"]["shape_rows"]


def test_sweep_offset_from_clean_run_steps_is_reported(tmp_path: Path):
    """Runs whose clean mixed steps hold 0.5 ms more than the sweep's forward + logits."""
    runs = [eager_run(tmp_path / "r", seed=4, mixed_clean=True, mixed_extra_ms=0.5)]
    cal = calibrate(runs, shapes=[fake_sweep(tmp_path / "s.parquet")])
    q = cal.quality["gpu_pass.mixed.runs_vs_sweep"]
    assert q["n"] > 20 and q["offset_ms"] == pytest.approx(0.5, rel=1e-6)
    assert q["total_rel_error"] < 0
    assert any("gpu_pass.mixed: the" in n and "+0.500 ms" in n for n in cal.notes)
    fitted = cal.quality["gpu_pass.mixed.fitted_on"]
    assert fitted["run_steps"] == q["n"] and fitted["shape_rows"] > 20


def test_eager_decode_rows_are_compared_not_fitted_for_graph_runs(tmp_path: Path):
    runs = [eager_run(tmp_path / "r", seed=1)]
    sweep = fake_sweep(tmp_path / "s.parquet", decode_graph=False)
    cal = calibrate(runs, shapes=[sweep], shapes_kinds=("decode", "mixed"))
    assert cal.quality["gpu_pass.decode.fitted_on"]["shape_rows"] == 0
    assert cal.quality["gpu_pass.decode.shapes"]["n"] > 10
    assert any("timed eagerly but the runs ran decode as CUDA graph" in n for n in cal.notes)


def test_shapes_kinds_limits_what_joins(tmp_path: Path):
    runs = [eager_run(tmp_path / "r", seed=1)]
    f = fake_sweep(tmp_path / "s.parquet")
    cal = calibrate(runs, shapes=[f], shapes_kinds=("mixed",))
    assert cal.quality["gpu_pass.decode.fitted_on"]["shape_rows"] == 0
    assert cal.quality["gpu_pass.decode.shapes"]["n"] > 10  # still reported
    assert cal.quality["gpu_pass.mixed.fitted_on"]["shape_rows"] > 20
    cal = calibrate(runs, shapes=[f], shapes_kinds=("decode",))
    assert "mixed" not in cal.profile["gpu_pass"]
    assert cal.quality["gpu_pass.decode.fitted_on"]["shape_rows"] > 10
    with pytest.raises(CalibrationError, match="shape kinds"):
        calibrate(runs, shapes=[f], shapes_kinds=("prefill",))


@pytest.mark.slow
def test_calibrate_with_a_real_cpu_sweep(tmp_path: Path, cpu_sweep: Path):
    cfg = Config(model="tiny", device="cpu")
    runs = [eager_run(tmp_path / "r", seed=2, gpu=gpu_name(cfg), cfg=cfg)]
    cal = calibrate(runs, shapes=[cpu_sweep], shapes_kinds=("decode", "mixed"))
    rows = read_sweeps([cpu_sweep])
    q = cal.quality
    assert q["gpu_pass.mixed.fitted_on"]["shape_rows"] == int((~rows.decode).sum())
    assert q["gpu_pass.mixed.fitted_on"]["run_steps"] == 0
    # CPU runs launch decode eagerly, as the CPU sweep timed it: those rows join the fit
    # (but those with history rows, which fit gpu_pass.history alone)
    plain = rows.decode & ~rows.history()
    assert q["gpu_pass.decode.fitted_on"]["shape_rows"] == int(plain.sum())
    assert cal.profile["gpu_pass"]["mixed"]


def _bad_files(tmp_path: Path) -> list[tuple[Path, str]]:
    out = [
        (fake_sweep(tmp_path / "model.parquet", model="small"), "another model"),
        (fake_sweep(tmp_path / "gpu.parquet", gpu="NVIDIA H200"), "another gpu"),
        (fake_sweep(tmp_path / "dtype.parquet", dtype="float16"), "another dtype"),
        (tmp_path / "missing.parquet", "does not exist"),
    ]
    text = tmp_path / "text.parquet"
    text.write_text("not parquet\n")
    out.append((text, "not a parquet file"))
    good = pq.read_table(fake_sweep(tmp_path / "good.parquet"))
    plain = tmp_path / "plain.parquet"
    pq.write_table(good.replace_schema_metadata({}), plain)
    out.append((plain, "not written by `replay shapes`"))
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(good.drop_columns(["attn_pairs"]), nocol)
    out.append((nocol, r"missing column\(s\) \['attn_pairs'\]"))
    zero = tmp_path / "zero.parquet"
    ms = good.column("gpu_ms").to_numpy().copy()
    ms[3] = 0.0
    i = good.column_names.index("gpu_ms")
    pq.write_table(good.set_column(i, "gpu_ms", pa.array(ms)), zero)
    out.append((zero, "row 3: gpu_ms 0.0 is not > 0"))
    return out


def test_a_bad_shapes_file_is_one_clear_error(tmp_path: Path, capsys):
    from replay.__main__ import main

    run = eager_run(tmp_path / "r", seed=0)
    for path, why in _bad_files(tmp_path):
        with pytest.raises(CalibrationError, match=why):
            calibrate([run], shapes=[path])
        prof = tmp_path / "p.json"
        with pytest.raises(SystemExit) as e:
            run_main(main, ["calibrate", str(run), "--shapes", str(path), "-o", str(prof)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: shapes file '{path}'"), err
        assert err.count("\n") == 1 and not prof.exists()


def test_calibrate_cli_with_shapes(tmp_path: Path, capsys):
    from replay.__main__ import main

    runs = [str(eager_run(tmp_path / f"r{i}", seed=i)) for i in range(2)]
    f = str(fake_sweep(tmp_path / "s.parquet"))
    prof = tmp_path / "p.json"
    assert main(["calibrate", *runs, "--shapes", f, "--shapes", f, "-o", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "fit on 2 run(s) + 2 shape sweep(s)" in out and "gpu_pass.mixed.fitted_on" in out
    rep = json.loads((tmp_path / "p.fit.json").read_text())
    n_mixed = sum(1 for b in grid(Limits(512, 64, 40000)) if b.kind == "mixed")
    assert rep["fit"]["gpu_pass.mixed.fitted_on"]["shape_rows"] == 2 * n_mixed


# ---- on the GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_sweep_samples_are_clean(tmp_path: Path):
    """Every kept sample of a small CUDA sweep is clean (the host had issued the whole step
    before the GPU reached the start event); an unclean one is discarded and re-measured behind
    a longer spin, which must stay rare (the H100 run of 2026-11-26 retried 1 of 66 samples:
    the first-try-only form of this test failed there); eager steps of the tiny model take less
    GPU time than their launch, which the timings must not contain; decode rows replay graphs."""
    cfg = Config(
        model="tiny",
        device="cuda",
        max_num_batched_tokens=512,
        max_num_seqs=32,
        max_model_len=4096,
        gc_freeze=False,
    )
    res = sweep(cfg, tmp_path / "g.parquet", repeats=3, quick=10)
    assert res.complete and res.dropped_shapes == 0
    t = pq.read_table(res.path)
    d = {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}
    assert (d["repeats"] == 3).all() and (d["gpu_ms"] > 0).all()
    # retries are rare: at most one per shape and a tenth of all samples
    assert (d["unclean"] <= 1).all() and res.unclean_samples <= 0.1 * d["repeats"].sum()
    assert (d["spin_ms"] > d["issue_ms"]).all()
    mixed = d["kind"].astype(str) == "mixed"
    assert mixed.any() and not d["graph"][mixed].any()
    assert np.median(d["gpu_ms"][mixed]) < np.median(d["issue_ms"][mixed])
    dec = ~mixed
    assert dec.any() and d["graph"][dec].all()
    assert (d["bucket"][dec] >= d["num_reqs"][dec]).all()
    meta = json.loads(t.schema.metadata[META_KEY])
    assert meta["gpu"] == torch.cuda.get_device_name() and meta["spin_cycles_per_ms"] > 0
    assert meta["attn_backend"] == "triton" and meta["graph_buckets"]
    assert meta["measures"] == "step" and meta["graphs_sample"]  # graphs hold the sampling


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ngram-gpu", "ngram-cpu"])
def test_gpu_sweep_with_speculative_decoding(tmp_path: Path, method: str):
    """Verification steps: rows of k drafts each replay the spec graphs (eager sampling after
    them), other widths run eagerly; every sample clean."""
    cfg = Config(
        model="tiny",
        device="cuda",
        max_num_batched_tokens=512,
        max_num_seqs=32,
        max_model_len=4096,
        gc_freeze=False,
    ).replace(**{"spec.method": method, "spec.k": 3})
    res = sweep(cfg, tmp_path / "s.parquet", repeats=2, kinds=("decode",), points=40)
    assert res.complete and res.dropped_shapes == 0
    t = pq.read_table(res.path)
    d = {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}
    uniform = d["draft_tokens"] == 3 * d["num_reqs"]
    assert uniform.any() and (~uniform).any() and (d["spec_k"] == 3).all()
    assert d["graph"][uniform].all() and not d["graph"][~uniform].any()
    assert (d["max_query_len"][uniform] == 4).all()


def test_batch_kinds():
    b = Batch("x", (Entry(0, 8, True), Entry(99, 1, False)))
    assert b.kind == "mixed" and b.num_tokens == 9 and b.max_seq_len == 100
    assert Batch("y", (Entry(9, 1, False),)).kind == "decode"
