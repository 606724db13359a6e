"""Fit the simulator's cost profile from measured runs (`python -m replay calibrate`).

Each fit is least squares over the BatchShape fields that steps.parquet records, with
non-negative coefficients (every term is a cost), one linear model per target:
- GPU pass, per batch kind (pure decode / mixed): `GPU_TERMS`. Only "clean" steps are used
  when there are enough: steps whose GPU work started after their launch phase ended, so the
  interval holds kernels alone, not kernels trickling in behind an eager launch.
- each CPU phase: a + b*num_reqs + c*num_tokens + the phase's extra fields (`PHASE_TERMS`),
  on the phase's duration less any GC pause or sync wait inside it (the sim adds GC itself).
- launch: graph and eager launches as two indicator columns (-> `launch.graph_ms`,
  `launch.eager_ms`, per-node costs 0) plus a residual in num_reqs/num_tokens
  (-> `cpu_phases.launch`).
- GC: the mean pause of each generation that paused (-> `gc.pause_ms[g]`, per-object cost 0;
  the hooks record no object counts).
Seed and speculative-decoding terms (sim.cost.terms) active in a run are part of what was
measured. A term active in some of the runs and not in others (an ablation) is fitted as its
own column block (term fields x "term active") and written to `terms`; every other active
term is subtracted at its default value before fitting, so the sim adds back exactly what was
taken out (docs/cost-model.md, "Calibration is plain least squares").

Pure numpy + pyarrow; `sim.cost` (pure Python) is imported lazily for the profile format.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.config import Config, from_dict
from core.phases import CPU_PHASES, LAUNCH
from core.runfmt import Run, load_run
from core.shape import SHAPE_FIELDS
from replay.lsq import fit, numeric_rank
from replay.outdir import atomic_file

GPU_TERMS: dict[str, tuple[str, ...]] = {
    "decode": ("intercept", "num_tokens", "kv_read_tokens", "num_reqs"),
    "mixed": (
        "intercept",
        "num_tokens",
        "kv_read_tokens",
        "attn_pairs",
        "num_reqs",
        "num_prefill_reqs",
    ),
}
PHASE_TERMS: dict[str, tuple[str, ...]] = {
    "schedule": ("intercept", "num_reqs", "num_tokens", "new_reqs"),
    "prepare_inputs": ("intercept", "num_reqs", "num_tokens", "new_reqs", "context_tokens"),
    "sample": ("intercept", "num_reqs", "num_tokens", "history_tokens"),
    "draft": ("intercept", "num_reqs", "draft_tokens", "context_tokens"),
    "process_outputs": ("intercept", "num_reqs", "num_tokens", "draft_tokens", "finished_reqs"),
}
LAUNCH_RESIDUAL_TERMS = ("num_reqs", "num_tokens")
MIN_CLEAN_STEPS = 20
# GPU event times reach the host clock through one base event (engine.hooks), good to a few us
CLEAN_TOL_S = 10e-6
GPU_PRESET_NAMES = ("h200", "h100", "a100", "l40s")  # matched in a CUDA device name, in order


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


# ---- loading ------------------------------------------------------------------------------------
def run_config(run: Run) -> Config:
    cfg = run.summary.get("config")
    if not isinstance(cfg, dict):
        raise CalibrationError(f"run '{run.path}': summary.json has no config")
    return from_dict(cfg)


def load_steps(runs: Sequence[Run]) -> Steps:
    from sim.cost.terms import TERM_NAMES, active_terms

    parts = [_run_steps(r, i) for i, r in enumerate(runs)]
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    cols = {f: cat[f].astype(np.float64) for f in SHAPE_FIELDS}
    cols["num_tokens"] = cols["prefill_tokens"] + cols["decode_tokens"]
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
    launch_end = ends[:, CPU_PHASES.index(LAUNCH)]
    out["clean"] = np.isfinite(launch_end) & (s["gpu_start_s"] >= launch_end - CLEAN_TOL_S)
    out["graph"] = _graph_steps(run, s)
    out["run"] = np.full(n, index)
    return out


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
        from sim.cost import load_profile, resolve_profile

        own = load_profile(cfg.profile) if cfg.profile and Path(cfg.profile).is_file() else None
        limit = resolve_profile(own)["launch"]["graph_max_tokens"]
        return cfg.cuda_graphs & decode & (s["decode_tokens"] <= limit)
    if not cfg.cuda_graphs or cfg.device != "cuda":
        return np.zeros(len(decode), bool)
    max_bucket = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    return decode & (s["draft_tokens"] == 0) & (s["num_reqs"] <= max_bucket)


# ---- fitting ------------------------------------------------------------------------------------
def _eval(model: Mapping[str, float], cols: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    out = np.zeros(int(rows.sum()) if rows.dtype == bool else len(rows))
    for term, coef in model.items():
        out += coef * cols[term][rows]
    return out


@dataclass
class TargetFit:
    model: dict[str, float]  # base linear model (ms)
    terms: dict[str, dict[str, float]]  # fitted seed terms
    rows: np.ndarray  # bool mask of the steps used
    note: str = ""


def fit_target(
    steps: Steps,
    y: np.ndarray,
    rows: np.ndarray,
    base_terms: Sequence[str],
    target: str,
    default_terms: Mapping[str, Mapping[str, float]],
) -> TargetFit:
    """Fit y[rows] = base model + free seed terms of `target` (+ fixed ones, subtracted)."""
    from sim.cost.terms import TERM_NAMES, term_target

    mine = [t for t in TERM_NAMES if term_target(t) == target]
    y = y[rows].copy()
    free: list[str] = []
    for t in mine:
        on = steps.active[t][rows]
        if on.any() and not on.all() and target != "gpu":
            free.append(t)  # varies across the runs: fit it
        elif on.any():
            y -= np.where(on, _eval(default_terms[t], steps.cols, rows), 0.0)
    cols: list[np.ndarray] = []
    names: list[tuple[str, str]] = []  # (block, field): block "" = base

    def try_add(block: str, fields: Sequence[str], mask: np.ndarray | None) -> bool:
        pairs = [(f, steps.cols[f][rows] * (1.0 if mask is None else mask)) for f in fields]
        pairs = [(f, c) for f, c in pairs if np.any(c)]
        if not pairs:
            return False
        trial = np.column_stack([*cols, *(c for _, c in pairs)])
        if numeric_rank(trial) < trial.shape[1]:
            return False
        cols.extend(c for _, c in pairs)
        names.extend((block, f) for f, _ in pairs)
        return True

    for f in base_terms:  # greedy: a field adds a column only if it adds information
        try_add("", [f], None)
    for t in free:
        fields = list(default_terms[t]) or ["intercept"]
        on = steps.active[t][rows].astype(np.float64)
        if not try_add(t, fields, on):
            y -= on * _eval(default_terms[t], steps.cols, rows)  # not separable: keep default
    if not cols:
        return TargetFit({}, {}, rows, "no data")
    x = np.column_stack(cols)
    res = fit(x, y)
    # round-off: a coefficient whose largest contribution is below 1e-9 of the target is 0
    floor = 1e-9 * float(np.abs(y).max(initial=0.0))
    coef = np.where(res.coef * np.abs(x).max(axis=0) > floor, res.coef, 0.0)
    model: dict[str, float] = {}
    terms: dict[str, dict[str, float]] = {}
    for (block, f), c in zip(names, coef.tolist()):
        if block == "":
            if c:
                model[f] = c
        else:
            terms.setdefault(block, {})[f] = c
    return TargetFit(model, terms, rows)


@dataclass
class Calibration:
    profile: dict[str, Any]
    quality: dict[str, Any]  # target -> fit statistics on the calibration runs
    notes: list[str]


def calibrate(
    run_dirs: Sequence[str | Path],
    gpu_terms: Mapping[str, Sequence[str]] | None = None,
    gpu_preset: str | None = None,
) -> Calibration:
    from sim.cost import default_profile

    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise CalibrationError("calibrate needs at least one run folder")
    identity, notes = _identity(runs, gpu_preset)
    steps = load_steps(runs)
    defaults = default_profile()
    dterms = defaults["terms"]
    gterms = {**GPU_TERMS, **(gpu_terms or {})}
    prof: dict[str, Any] = {
        "version": defaults["version"],
        **identity,
        "source_runs": [str(r.path) for r in runs],
    }
    fitted_terms: dict[str, dict[str, float]] = {}
    # GPU pass, per kind
    gpu_y = steps.gpu_ms - _draft_gpu_ms(runs, steps)
    decode = steps.cols["num_prefill_reqs"] == 0
    gp: dict[str, Any] = {}
    for kind, mask in (("decode", decode), ("mixed", ~decode)):
        have = mask & np.isfinite(gpu_y)
        clean = have & steps.clean
        rows = clean if clean.sum() >= max(MIN_CLEAN_STEPS, 3 * len(gterms[kind])) else have
        if not rows.any():
            notes.append(f"gpu_pass.{kind}: no steps of this kind; keeping the roofline")
            continue
        if rows is have and clean.sum() < have.sum():
            notes.append(
                f"gpu_pass.{kind}: only {int(clean.sum())} clean steps; fitted on all "
                f"{int(have.sum())} (some GPU intervals include launch time)"
            )
        gp[kind] = fit_target(steps, gpu_y, rows, gterms[kind], "gpu", dterms).model
    if gp:
        prof["gpu_pass"] = gp
    # CPU phases
    cpu: dict[str, dict[str, float]] = {}
    for phase, base in PHASE_TERMS.items():
        y = steps.phase_ms[phase]
        rows = np.isfinite(y)
        if not rows.any():
            continue
        tf = fit_target(steps, y, rows, base, phase, dterms)
        cpu[phase] = tf.model
        fitted_terms.update(tf.terms)
    launch_prof, launch_model = _fit_launch(steps)
    if launch_prof:
        prof["launch"] = launch_prof
        cpu[LAUNCH] = launch_model
    if cpu:
        prof["cpu_phases"] = {p: cpu[p] for p in CPU_PHASES if p in cpu}
    if fitted_terms:
        prof["terms"] = fitted_terms
        notes.append("fitted seed terms (active in some runs only): " + ", ".join(fitted_terms))
    gc = _fit_gc(runs, defaults["gc"])
    if gc:
        prof["gc"] = gc
    from sim.cost import validate_profile

    validate_profile(prof)
    quality = evaluate(prof, runs, steps)
    return Calibration(prof, quality, notes)


def _draft_gpu_ms(runs: Sequence[Run], steps: Steps) -> np.ndarray:
    """The n-gram GPU proposer's modelled time per step (0 unless spec.method=ngram-gpu): the
    measured GPU interval holds it, the sim adds it apart from the GPU pass."""
    out = np.zeros(len(steps))
    for i, r in enumerate(runs):
        cfg = run_config(r)
        if cfg.spec.method != "ngram-gpu":
            continue
        from sim.cost import CostModel

        cm = CostModel(cfg.replace(profile=""))
        rows = np.flatnonzero(steps.run == i)
        out[rows] = [cm.draft_gpu_ms(s) for s in _shapes(steps, rows)]
    return out


def _shapes(steps: Steps, rows: np.ndarray) -> list[Any]:
    from core.shape import BatchShape

    cols = [steps.cols[f][rows].astype(np.int64).tolist() for f in SHAPE_FIELDS]
    return [BatchShape(*vals) for vals in zip(*cols)]


def _fit_launch(steps: Steps) -> tuple[dict[str, float], dict[str, float]]:
    y = steps.phase_ms[LAUNCH]
    rows = np.isfinite(y)
    if not rows.any():
        return {}, {}
    g = steps.graph[rows].astype(np.float64)
    x = [g, 1.0 - g] + [steps.cols[f][rows] for f in LAUNCH_RESIDUAL_TERMS]
    res = fit(np.column_stack(x), y[rows])
    c_graph, c_eager, *resid = res.coef.tolist()
    prof: dict[str, float] = {}
    if g.any():
        prof.update(graph_ms=c_graph, graph_ms_per_node=0.0)
    if (1 - g).any():
        prof.update(eager_ms=c_eager, eager_ms_per_kernel=0.0)
    return prof, {f: c for f, c in zip(LAUNCH_RESIDUAL_TERMS, resid) if c}


def _fit_gc(runs: Sequence[Run], default: Mapping[str, list[float]]) -> dict[str, list[float]]:
    dur = np.concatenate([r.arrays("gc")["duration_s"] for r in runs]) * 1e3
    gen = np.concatenate([r.arrays("gc")["generation"] for r in runs])
    if dur.size == 0:
        return {}
    a, b = list(default["pause_ms"]), list(default["pause_ms_per_object"])
    for g in range(3):
        d = dur[gen == g]
        if d.size:
            a[g], b[g] = float(d.mean()), 0.0
    return {"pause_ms": a, "pause_ms_per_object": b}


def _identity(runs: Sequence[Run], gpu_preset: str | None) -> tuple[dict[str, str], list[str]]:
    """gpu (preset name), model, dtype, date, notes for the profile; all runs must agree."""
    cfgs = [run_config(r) for r in runs]
    for key in ("model", "dtype"):
        vals = sorted({str(getattr(c, key)) for c in cfgs})
        if len(vals) > 1:
            raise CalibrationError(f"the runs mix {key}s {vals}: calibrate one {key} at a time")
    names = sorted({_gpu_name(r, c) for r, c in zip(runs, cfgs)})
    if len(names) > 1:
        raise CalibrationError(f"the runs come from different GPUs {names}: one at a time")
    notes: list[str] = []
    preset = gpu_preset or _preset_for(names[0])
    out = {"model": cfgs[0].model, "dtype": cfgs[0].dtype}
    if preset:
        out["gpu"] = preset
    else:
        notes.append(f"GPU '{names[0]}' matches no preset: the profile names no gpu")
    out["date"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    kinds = sorted({(r.summary.get("source") or {}).get("kind", "?") for r in runs})
    out["notes"] = f"replay calibrate from {len(runs)} {'/'.join(kinds)} run(s) on '{names[0]}'"
    return out, notes


def _gpu_name(run: Run, cfg: Config) -> str:
    src = run.summary.get("source") or {}
    return str(src.get("gpu") or cfg.gpu)


def _preset_for(name: str) -> str | None:
    low = name.lower()
    return next((p for p in GPU_PRESET_NAMES if p in low), None)


# ---- fit quality --------------------------------------------------------------------------------
def evaluate(profile: Mapping[str, Any], runs: Sequence[Run], steps: Steps | None = None):
    """Fit statistics of `profile` on `runs`: predicted (as the sim computes it: base model +
    active terms) vs measured time per step, per target."""
    from sim.cost import resolve_profile

    steps = steps or load_steps(runs)
    prof = resolve_profile(profile)
    out: dict[str, Any] = {}
    decode = steps.cols["num_prefill_reqs"] == 0
    gpu_extra = _active_terms_ms(prof, steps, "gpu")
    gpu_y = steps.gpu_ms - _draft_gpu_ms(runs, steps)
    for kind, mask in (("decode", decode), ("mixed", ~decode)):
        rows = mask & np.isfinite(gpu_y)
        if kind not in prof["gpu_pass"] or not rows.any():
            continue
        pred = _eval(prof["gpu_pass"][kind], steps.cols, rows) + gpu_extra[rows]
        out[f"gpu_pass.{kind}"] = stats(pred, gpu_y[rows])
        clean = rows & steps.clean
        if clean.any() and clean.sum() < rows.sum():
            pc = _eval(prof["gpu_pass"][kind], steps.cols, clean) + gpu_extra[clean]
            out[f"gpu_pass.{kind}.clean"] = stats(pc, gpu_y[clean])
    la = prof["launch"]
    for phase in CPU_PHASES:
        y = steps.phase_ms[phase]
        rows = np.isfinite(y)
        if not rows.any():
            continue
        pred = _eval(prof["cpu_phases"].get(phase, {}), steps.cols, rows)
        pred += _active_terms_ms(prof, steps, phase)[rows]
        if phase == LAUNCH:
            nodes = _nodes(runs, steps, la)
            graph_ms = la["graph_ms"] + la["graph_ms_per_node"] * nodes
            eager_ms = la["eager_ms"] + la["eager_ms_per_kernel"] * nodes
            pred += np.where(steps.graph, graph_ms, eager_ms)[rows]
        out[f"cpu_phases.{phase}"] = stats(pred, y[rows])
    return out


def _active_terms_ms(prof: Mapping[str, Any], steps: Steps, target: str) -> np.ndarray:
    from sim.cost.terms import TERM_NAMES, term_target

    all_rows = np.ones(len(steps), bool)
    out = np.zeros(len(steps))
    for t in TERM_NAMES:
        if term_target(t) == target and steps.active[t].any():
            out += np.where(steps.active[t], _eval(prof["terms"][t], steps.cols, all_rows), 0.0)
    return out


def _nodes(runs: Sequence[Run], steps: Steps, la: Mapping[str, Any]) -> np.ndarray:
    from core.models import get_model

    per_run = []
    for r in runs:
        try:
            layers = get_model(run_config(r).model).num_layers
        except ValueError:
            layers = 0  # a checkpoint folder not on this machine: per-node terms are 0 here
        per_run.append(la["kernels_per_layer"] * layers + la["kernels_fixed"])
    return np.asarray(per_run, np.float64)[steps.run]


def stats(pred: np.ndarray, meas: np.ndarray) -> dict[str, Any]:
    """n, R², RMSE, mean |relative error| per step, and the error of the total (sum) time."""
    if meas.size == 0:
        return {"n": 0}
    resid = meas - pred
    ss_tot = float(((meas - meas.mean()) ** 2).sum())
    pos = meas > 0
    rel = np.abs(pred[pos] - meas[pos]) / meas[pos]
    total = float(meas.sum())
    return {
        "n": int(meas.size),
        "r2": 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else None,
        "rmse_ms": float(np.sqrt((resid**2).mean())),
        "measured_mean_ms": float(meas.mean()),
        "predicted_mean_ms": float(pred.mean()),
        "mean_abs_rel_error": float(rel.mean()) if rel.size else None,
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)) if rel.size else None,
        "total_rel_error": float(pred.sum()) / total - 1.0 if total > 0 else None,
    }


# ---- output -------------------------------------------------------------------------------------
def write_calibration(cal: Calibration, path: str | Path, checks: dict[str, Any]) -> Path:
    """The profile (sim.cost.save_profile: validated, atomic) and `<stem>.fit.json` beside it."""
    from sim.cost import save_profile

    p = save_profile(path, cal.profile)
    report = {"profile": str(p), "fit": cal.quality, "check": checks, "notes": cal.notes}
    text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    return atomic_file(p.with_name(p.stem + ".fit.json"), text)


def print_quality(title: str, quality: Mapping[str, Any]) -> None:
    print(title)
    print(
        f"  {'target':<28} {'n':>7} {'R²':>7} {'meas ms':>9} {'pred ms':>9} {'|rel err|':>9} "
        f"{'total':>8}"
    )
    for name, q in quality.items():
        if not q.get("n"):
            continue
        r2 = "-" if q["r2"] is None else f"{q['r2']:.3f}"
        rel = "-" if q["mean_abs_rel_error"] is None else f"{100 * q['mean_abs_rel_error']:.1f}%"
        tot = "-" if q["total_rel_error"] is None else f"{100 * q['total_rel_error']:+.1f}%"
        print(
            f"  {name:<28} {q['n']:>7} {r2:>7} {q['measured_mean_ms']:>9.4f} "
            f"{q['predicted_mean_ms']:>9.4f} {rel:>9} {tot:>8}"
        )
