"""The steps of measured (or predicted) runs as columns for fitting: BatchShape fields, CPU
phase durations less the GC pauses and sync waits inside them, GPU intervals with the "clean"
flag (GPU work began after the host had issued it all, so the interval is kernels only), whether the
launch was a CUDA graph, and which seed terms (sim.cost.terms) were active in each step's run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from bubblesim.core.config import Config, from_dict
from bubblesim.core.models import get_model
from bubblesim.core.phases import CPU_PHASES, DRAFT, LAUNCH, SAMPLE
from bubblesim.core.runfmt import Run
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from sim.cost import CostModel, load_profile, resolve_profile
from sim.cost.mixedsplits import chunk_spread, mixed_attention_fn
from sim.cost.splits import num_sms, program_keys_fn, tail_keys_fn
from sim.cost.table import SPLINE_KEY, TABLE_KEY, spline_values, table_values
from sim.cost.terms import TERM_NAMES, active_terms

# sim.cost.mixedsplits.MIXED_DERIVED (sim is imported lazily here: the GPU host has no simpy)
MIXED_DERIVED = ("mixed_keys", "grid_blocks", "chunk_spread")

# GPU event times reach the host clock through one base event (engine.hooks), good to a few us
CLEAN_TOL_S = 10e-6


class CalibrationError(ValueError):
    """Runs that cannot be calibrated from; the message names the run and the reason."""


@dataclass
class Steps:
    """The steps of one or more runs, as columns (times in ms)."""

    cols: dict[str, np.ndarray]  # shape fields, "num_tokens", "intercept"
    phase_ms: dict[str, np.ndarray]  # CPU phase durations less GC/sync inside; NaN = absent
    gpu_ms: np.ndarray
    clean: np.ndarray  # bool: GPU work began after the launch phase ended
    graph: np.ndarray  # bool: the launch was a CUDA graph replay
    run: np.ndarray  # index into the run list
    active: dict[str, np.ndarray] = field(default_factory=dict)  # term -> bool per step

    def __len__(self) -> int:
        return len(self.run)


def run_config(run: Run) -> Config:
    cfg = run.summary.get("config")
    if not isinstance(cfg, dict):
        raise CalibrationError(f"run '{run.path}': summary.json has no config")
    return from_dict(cfg)


def predicted_gpu_ms(
    run: Run, profile: Mapping[str, Any], s: Mapping[str, np.ndarray], rows: np.ndarray
) -> np.ndarray:
    """The GPU pass the simulator predicts for the steps `rows` of `run` (its step columns
    `s`), with the run's config and a (partial) `profile` whose GPU/model/dtype names are not
    checked (a fit in progress is evaluated on the runs it comes from)."""
    fit = {k: v for k, v in profile.items() if k not in ("gpu", "model", "dtype")}
    cost = CostModel(run_config(run).replace(profile=""), fit)
    cols = {f: s[f] for f in SHAPE_FIELDS}
    return np.array(
        [
            cost.gpu_pass_ms(BatchShape(**{f: int(c[i]) for f, c in cols.items()}))
            for i in rows.tolist()
        ]
    )


def load_steps(runs: Sequence[Run]) -> Steps:
    parts = [_run_steps(r, i) for i, r in enumerate(runs)]
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    cols = {f: cat[f].astype(np.float64) for f in SHAPE_FIELDS}
    cols["num_tokens"] = cols["prefill_tokens"] + cols["decode_tokens"]
    cols["program_keys"] = cat["program_keys"].astype(np.float64)
    cols["tail_keys"] = cat["tail_keys"].astype(np.float64)
    for term in MIXED_DERIVED:
        cols[term] = cat[term].astype(np.float64)
    cols["intercept"] = np.ones(len(cat["run"]))
    steps = Steps(
        cols=cols,
        phase_ms={p: cat[f"ms:{p}"] for p in CPU_PHASES},
        gpu_ms=cat["gpu_ms"],
        clean=cat["clean"].astype(bool),
        graph=cat["graph"].astype(bool),
        run=cat["run"].astype(np.int64),
    )
    cfgs = [run_config(r) for r in runs]
    for t in TERM_NAMES:
        on = np.array([t in active_terms(c) for c in cfgs], bool)
        steps.active[t] = on[steps.run] if len(steps) else np.zeros(0, bool)
    return steps


def _run_steps(run: Run, index: int) -> dict[str, np.ndarray]:
    s = run.arrays("steps")
    n = len(s["step"])
    out: dict[str, np.ndarray] = {f: s[f] for f in SHAPE_FIELDS}
    starts = np.stack([s[f"{p}_start_s"] for p in CPU_PHASES], axis=1)
    ends = np.stack([s[f"{p}_end_s"] for p in CPU_PHASES], axis=1)
    dur = ends - starts
    g, sync = run.arrays("gc"), _sync_waits(s)
    _subtract_inside(dur, starts, ends, g["start_s"], g["duration_s"])
    _subtract_inside(dur, starts, ends, *sync)
    for j, p in enumerate(CPU_PHASES):
        out[f"ms:{p}"] = dur[:, j] * 1e3
    out["gpu_ms"] = (s["gpu_end_s"] - s["gpu_start_s"]) * 1e3
    out["clean"] = _clean(run, s, ends)
    out["graph"] = _graph_steps(run, s)
    out["run"] = np.full(n, index)
    out["program_keys"] = program_keys(run, s["num_reqs"], s["max_kv_tokens"])
    out["tail_keys"] = tail_keys(run, s["num_reqs"], s["kv_read_tokens"], s["max_kv_tokens"])
    out.update(mixed_attention(run, s))
    return out


def program_keys(run: Run, num_reqs: np.ndarray, max_kv: np.ndarray) -> np.ndarray:
    """The derived term `program_keys` (sim.cost.splits) of each step: keys of the longest decode
    attention program for the run's model and GPU (one rank's KV heads under tensor
    parallelism); zeros where either is unknown here."""
    cfg = run_config(run)
    sms = num_sms(str((run.summary.get("source") or {}).get("gpu") or cfg.gpu))
    try:
        kv_heads = get_model(cfg.model).kv_heads_per_rank(cfg.tensor_parallel_size)
    except ValueError:  # a checkpoint folder not on this machine
        sms = None
    if sms is None:
        return np.zeros(len(num_reqs))
    keys = program_keys_fn(kv_heads, sms)
    return np.array([keys(int(r), int(m)) for r, m in zip(num_reqs, max_kv)], np.float64)


def tail_keys(
    run: Run, num_reqs: np.ndarray, kv_read: np.ndarray, max_kv: np.ndarray
) -> np.ndarray:
    """The derived decode term `tail_keys` (sim.cost.splits) of each step, as program_keys:
    zeros where the run's model or GPU is unknown here."""
    heads = _model_heads(run)
    if heads is None:
        return np.zeros(len(num_reqs))
    fn = tail_keys_fn(heads[1], heads[2])
    cols = zip(num_reqs.tolist(), kv_read.tolist(), max_kv.tolist(), strict=True)
    return np.array([fn(int(n), int(k), int(m)) for n, k, m in cols], np.float64)


def mixed_attention(run: Run, cols: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The mixed-step derived terms (sim.cost.mixedsplits: `mixed_keys`, `grid_blocks`,
    `chunk_spread`) of each
    row of `cols` (shape fields) for the run's model and GPU; zeros where either is unknown."""
    n = len(cols["num_reqs"])
    out = {t: np.zeros(n) for t in MIXED_DERIVED}
    heads = _model_heads(run)
    if heads is None:
        return out
    fn = mixed_attention_fn(*heads)
    rows = np.flatnonzero(np.asarray(cols["num_prefill_reqs"]) > 0)
    fields = ("num_reqs", "num_prefill_reqs", "prefill_tokens", "kv_read_tokens", "attn_pairs",
              "max_kv_tokens", "decode_tokens", "draft_tokens")  # fmt: skip
    vals = np.stack([np.asarray(cols[f], np.float64) for f in fields], axis=1)
    for i in rows:
        s = SimpleNamespace(**dict(zip(fields, (int(v) for v in vals[i]))))
        out[MIXED_DERIVED[0]][i], out[MIXED_DERIVED[1]][i] = fn(s)
        out[MIXED_DERIVED[2]][i] = chunk_spread(s)
    return out


def _model_heads(run: Run) -> tuple[int, int, int] | None:
    """(query heads, kv heads, SMs) of one rank of the run's model and GPU, None where either
    is unknown."""
    cfg = run_config(run)
    sms = num_sms(str((run.summary.get("source") or {}).get("gpu") or cfg.gpu))
    try:
        model = get_model(cfg.model)
    except ValueError:  # a checkpoint folder not on this machine
        return None
    tp = cfg.tensor_parallel_size
    heads = (model.num_heads // tp, model.kv_heads_per_rank(tp))
    return None if sms is None else (*heads, sms)


def _clean(run: Run, s: dict[str, np.ndarray], ends: np.ndarray) -> np.ndarray:
    """Steps whose GPU interval holds kernels alone: the GPU began the step after the host had
    issued the forward (else an eager launch paces the kernels) and, in a measured run, after
    the host had enqueued the step's last GPU work too. The engine enqueues sampling at the end
    of `sample` (after seed 3's placeholder scan, for one) and the n-gram GPU proposer in
    `draft`, and records the step's end event there: a GPU that gets there first waits inside
    the interval, for host time the sim models as the CPU phase. The sim's passes never wait
    for those phases (sim.stream), so its runs need only the launch rule."""
    gpu_start = s["gpu_start_s"]
    launch_end = ends[:, CPU_PHASES.index(LAUNCH)]
    clean = np.isfinite(launch_end) & (gpu_start >= launch_end - CLEAN_TOL_S)
    if (run.summary.get("source") or {}).get("kind") == "sim":
        return clean
    last = DRAFT if run_config(run).spec.method == "ngram-gpu" else SAMPLE
    enqueued = ends[:, CPU_PHASES.index(last)]
    return clean & np.isfinite(enqueued) & (gpu_start >= enqueued - CLEAN_TOL_S)


def _sync_waits(s: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The longest sync wait of each step (steps.parquet keeps one per step with its total)."""
    ok = np.isfinite(s["sync_start_s"])
    return s["sync_start_s"][ok], (s["sync_end_s"] - s["sync_start_s"])[ok]


def _subtract_inside(
    dur: np.ndarray, starts: np.ndarray, ends: np.ndarray, t: np.ndarray, d: np.ndarray
) -> None:
    """Take each pause [t, t + d] out of the CPU phase interval it began in (phases of one
    thread never overlap, so at most one contains t)."""
    if t.size == 0:
        return
    ok = np.isfinite(starts) & (ends > starts)  # an empty phase contains nothing
    flat_s, flat_e = starts[ok], ends[ok]
    where = np.flatnonzero(ok.ravel())
    order = np.argsort(flat_s, kind="stable")
    flat_s, flat_e, where = flat_s[order], flat_e[order], where[order]
    i = np.searchsorted(flat_s, t, side="right") - 1
    inside = (i >= 0) & (t < flat_e[np.maximum(i, 0)])
    np.add.at(dur.ravel(), where[i[inside]], -d[inside])


def _graph_steps(run: Run, s: dict[str, np.ndarray]) -> np.ndarray:
    """Which steps launched a CUDA graph: the sim's rule for predicted runs, the engine's for
    measured ones (engine/graphs.py: pure decode, one query token per request, on CUDA)."""
    cfg = run_config(run)
    decode = s["num_prefill_reqs"] == 0
    if (run.summary.get("source") or {}).get("kind") == "sim":
        own = load_profile(cfg.profile) if cfg.profile and Path(cfg.profile).is_file() else None
        limit = resolve_profile(own)["launch"]["graph_max_tokens"]
        k = cfg.spec.k if cfg.spec.enabled else 0  # sim.cost.CostModel.graphed
        uniform = s["draft_tokens"] == k * s["num_reqs"]
        graphed = decode & (s["decode_tokens"] <= limit) & uniform
        if cfg.cuda_graphs_mixed and not cfg.spec.enabled:  # every step with a prefill
            graphed |= ~decode
        return cfg.cuda_graphs & graphed
    if not cfg.cuda_graphs or cfg.device != "cuda":
        return np.zeros(len(decode), bool)
    # engine.engine._prepare: pure decode with k drafts per request (none without spec), at
    # most the largest bucket (engine.graphs: k + 1 query tokens per row with drafts)
    q = cfg.spec.k + 1 if cfg.spec.enabled else 1
    max_bucket = min(cfg.max_num_seqs, max(cfg.max_num_batched_tokens, cfg.max_num_seqs) // q)
    uniform = s["draft_tokens"] == (q - 1) * s["num_reqs"]
    graphed = decode & uniform & (s["num_reqs"] <= max_bucket)
    if cfg.cuda_graphs_mixed and not cfg.spec.enabled:  # engine.mixed_graphs: every bucket
        graphed |= ~decode  # up to the step token limit is captured
    return graphed


def eval_linear(
    model: Mapping[str, float], cols: dict[str, np.ndarray], rows: np.ndarray
) -> np.ndarray:
    """A linear model's value on the selected steps (rows: a bool mask or indices); a GPU pass
    model `{"max": [...]}` is the larger of its branches; a `table`/`spline` term is evaluated
    by sim.cost.table's rule."""
    if "max" in model:
        parts: Any = model["max"]
        return np.maximum.reduce([eval_linear(b, cols, rows) for b in parts])
    out = np.zeros(int(rows.sum()) if rows.dtype == bool else len(rows))
    for term, coef in model.items():
        if term in (TABLE_KEY, SPLINE_KEY):  # a piecewise-linear term (sim.cost.table)
            sub = {k: v[rows] for k, v in cols.items()}
            piece = table_values if term == TABLE_KEY else spline_values
            out += piece(coef, sub)  # type: ignore[arg-type]
        else:
            out += coef * cols[term][rows]
    return out


def draft_gpu_ms(runs: Sequence[Run], steps: Steps) -> np.ndarray:
    """The n-gram GPU proposer's modelled time per step (0 unless spec.method=ngram-gpu): the
    measured GPU interval holds it, the sim adds it apart from the GPU pass."""
    out = np.zeros(len(steps))
    for i, r in enumerate(runs):
        cfg = run_config(r)
        if cfg.spec.method != "ngram-gpu":
            continue
        cm = CostModel(cfg.replace(profile=""))
        rows = np.flatnonzero(steps.run == i)
        out[rows] = [cm.draft_gpu_ms(s) for s in _shapes(steps, rows)]
    return out


def _shapes(steps: Steps, rows: np.ndarray) -> list[Any]:
    cols = [steps.cols[f][rows].astype(np.int64).tolist() for f in SHAPE_FIELDS]
    return [BatchShape(*vals) for vals in zip(*cols)]
