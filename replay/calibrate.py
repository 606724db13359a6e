"""Fit the simulator's cost profile from measured runs (`python -m replay calibrate`).

Each fit is least squares over the BatchShape fields that steps.parquet records, with
non-negative coefficients (every term is a cost), one linear model per target:
- GPU pass, per batch kind (pure decode / mixed): `GPU_TERMS`, on the "clean" steps only
  (replay.steps: GPU work began after the host had issued all of it, so the interval holds
  kernels alone, not kernels trickling in behind an eager launch or waiting for the host's
  sample/draft phase); with too few of them the kind keeps the base profile's model or the
  roofline (a note says so).
- each CPU phase: a + b*num_reqs + c*num_tokens + the phase's extra fields (`PHASE_TERMS`),
  on the phase's duration less any GC pause or sync wait inside it (the sim adds GC itself).
- launch: graph and eager launches (-> `launch.graph_ms`, `launch.eager_ms`, per-node costs 0)
  plus a residual in num_reqs/num_tokens (-> `cpu_phases.launch`) fitted on the graph replays
  when there are any (`_fit_launch`).
- GC: the mean pause of each generation that paused (-> `gc.pause_ms[g]`, per-object cost 0;
  the hooks record no object counts).
Seed and speculative-decoding terms (sim.cost.terms) active in a run are part of what was
measured. A term active in some of the runs and not in others (an ablation) is fitted as its
own column block (term fields x "term active") and written to `terms`; every other active
term is subtracted at its default value before fitting, so the sim adds back exactly what was
taken out (docs/cost-model.md, "Calibration is plain least squares").

One-sided calibration (`one_sided`, used by `replay ablate --calibrate-on`): a term active in
every run cannot be told from the phase's base model, so normally it is held at its value and
the base absorbs the rest. For the terms of `ONE_SIDED_FIELDS` this engine's cost differs from
the default by more than the effect to predict (a Python n-gram proposer, a Python placeholder
scan), so the fit gives the listed fields to the term instead (the base model of the phase
drops them): predicting the other side of the switch then removes what was measured, not the
default. `base` is the profile the simulator will use around the fit (its terms are what is
subtracted; default: the built-in defaults).

Pure numpy + pyarrow; `sim.cost` (pure Python) is imported lazily for the profile format.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.config import Config
from core.phases import CPU_PHASES, LAUNCH
from core.runfmt import Run, load_run
from replay.lsq import fit, numeric_rank
from replay.outdir import atomic_file
from replay.quality import evaluate, print_quality, stats
from replay.steps import CalibrationError, Steps, draft_gpu_ms, eval_linear, load_steps, run_config

__all__ = [
    "CalibrationError",
    "calibrate",
    "evaluate",
    "print_quality",
    "stats",
    "write_calibration",
]

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
# term -> fields a one-sided fit gives to the term (see the module docstring); every other term
# active in all runs keeps its value. Seed 4 before: engine.spec.ngram_cpu runs core.ngram in
# Python per request, O(context) (the default is vLLM's numba proposer); seed 3 before: the
# forward list.index scan, O(history).
ONE_SIDED_FIELDS: dict[str, tuple[str, ...]] = {
    "draft.ngram_cpu": ("intercept", "num_reqs", "context_tokens"),
    "sample.forward_placeholder_scan": ("history_tokens",),
}
LAUNCH_RESIDUAL_TERMS = ("num_reqs", "num_tokens")
OUTLIER_MADS = 5.0  # graph launches this far above the fit (robust sigmas) are one-off uploads
MIN_CLEAN_STEPS = 20
GPU_PRESET_NAMES = ("h200", "h100", "a100", "l40s")  # matched in a CUDA device name, in order


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
    one_sided: Mapping[str, Sequence[str]] | None = None,
) -> TargetFit:
    """Fit y[rows] = base model + free seed terms of `target` (+ fixed ones, subtracted).
    `one_sided`: term -> fields it takes when it is active on every row (module docstring)."""
    from sim.cost.terms import TERM_NAMES, term_target

    mine = [t for t in TERM_NAMES if term_target(t) == target]
    y = y[rows].copy()
    free: list[str] = []
    owned: dict[str, tuple[str, ...]] = {}  # one-sided terms -> the fields they take
    for t in mine:
        on = steps.active[t][rows]
        if on.any() and not on.all() and target != "gpu":
            free.append(t)  # varies across the runs: fit it
        elif on.all() and on.size and one_sided and t in one_sided and target != "gpu":
            free.append(t)
            owned[t] = tuple(one_sided[t])
        elif on.any():
            y -= np.where(on, eval_linear(default_terms[t], steps.cols, rows), 0.0)
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

    taken = {f for fields in owned.values() for f in fields}
    for f in base_terms:  # greedy: a field adds a column only if it adds information
        if f not in taken:
            try_add("", [f], None)
    for t in free:
        on = steps.active[t][rows].astype(np.float64)
        if t in owned:  # one field at a time: whatever the data can tell apart
            if not [f for f in owned[t] if try_add(t, [f], on)]:
                y -= on * eval_linear(default_terms[t], steps.cols, rows)
            continue
        fields = list(default_terms[t]) or ["intercept"]
        if not try_add(t, fields, on):
            y -= on * eval_linear(default_terms[t], steps.cols, rows)  # not separable: keep default
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
    base: Mapping[str, Any] | None = None,
    one_sided: Mapping[str, Sequence[str]] | None = None,
) -> Calibration:
    """`base`: the (partial) profile the fit is used with: its terms are the values held fixed
    (default: the built-in defaults). `one_sided`: see ONE_SIDED_FIELDS."""
    from sim.cost import resolve_profile

    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise CalibrationError("calibrate needs at least one run folder")
    identity, notes = _identity(runs, gpu_preset)
    steps = load_steps(runs)
    defaults = resolve_profile(base)
    dterms = defaults["terms"]
    gterms = {**GPU_TERMS, **(gpu_terms or {})}
    prof: dict[str, Any] = {
        "version": defaults["version"],
        **identity,
        "source_runs": [str(r.path) for r in runs],
    }
    fitted_terms: dict[str, dict[str, float]] = {}
    # GPU pass, per kind
    gpu_y = steps.gpu_ms - draft_gpu_ms(runs, steps)
    decode = steps.cols["num_prefill_reqs"] == 0
    gp: dict[str, Any] = {}
    for kind, mask in (("decode", decode), ("mixed", ~decode)):
        keep = "the base profile's" if kind in (base or {}).get("gpu_pass", {}) else "the roofline"
        have = mask & np.isfinite(gpu_y)
        clean = have & steps.clean
        if not have.any():
            notes.append(f"gpu_pass.{kind}: no steps of this kind; keeping {keep}")
            continue
        if clean.sum() < max(MIN_CLEAN_STEPS, 3 * len(gterms[kind])):
            # the other intervals are paced by an eager launch or the host: fitted as kernels,
            # they would come back in the sim twice (the sim adds the launch bound itself) and
            # stay when a switch removes the host work (a graph launch, a shorter phase)
            notes.append(
                f"gpu_pass.{kind}: only {int(clean.sum())} of {int(have.sum())} steps hold "
                f"kernels alone (the rest wait on the launch or the host); keeping {keep}"
            )
            continue
        gp[kind] = fit_target(steps, gpu_y, clean, gterms[kind], "gpu", dterms).model
    if gp:
        prof["gpu_pass"] = gp
    # CPU phases
    cpu: dict[str, dict[str, float]] = {}
    for phase, base_terms in PHASE_TERMS.items():
        y = steps.phase_ms[phase]
        rows = np.isfinite(y)
        if not rows.any():
            continue
        tf = fit_target(steps, y, rows, base_terms, phase, dterms, one_sided)
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
        notes.append("fitted seed terms: " + ", ".join(fitted_terms))
    gc = _fit_gc(runs, defaults["gc"])
    if gc:
        prof["gc"] = gc
    from sim.cost import merge_profile, validate_profile

    validate_profile(prof)
    quality = evaluate(merge_profile(base, prof) if base else prof, runs, steps)
    return Calibration(prof, quality, notes)


def _fit_launch(steps: Steps) -> tuple[dict[str, float], dict[str, float]]:
    """`launch.graph_ms` / `eager_ms` and the residual in LAUNCH_RESIDUAL_TERMS, which the sim
    adds to both kinds. The residual comes from the graph replays when there are any: an eager
    launch issues every kernel, so its shape dependence is not the residual's (fitted jointly,
    a mostly-eager run gave its per-request issue cost to the graph launches too); the eager
    intercept is then the eager steps' mean less the residual. Without graph replays the
    residual comes from the eager steps, as before. A graph replay's host cost is one
    cudaGraphLaunch whatever the batch (engine.graphs); its first launch also uploads the graph,
    so graph launches more than OUTLIER_MADS robust sigmas above the fit are left out of it."""
    y = steps.phase_ms[LAUNCH]
    rows = np.isfinite(y)
    if not rows.any():
        return {}, {}
    g = steps.graph & rows
    e = rows & ~steps.graph
    prof: dict[str, float] = {}
    fit_on = g if g.any() else e
    cols, names = [np.ones(int(fit_on.sum()))], ["intercept"]
    for f in LAUNCH_RESIDUAL_TERMS:  # a field enters only if it adds information
        trial = np.column_stack([*cols, steps.cols[f][fit_on]])
        if numeric_rank(trial) == trial.shape[1]:
            cols.append(steps.cols[f][fit_on])
            names.append(f)
    x, t = np.column_stack(cols), y[fit_on]
    res = fit(x, t)
    if g.any():  # the first replay of each captured graph uploads it: one-off, not per step
        dev = t - x @ res.coef
        mad = float(np.median(np.abs(dev - np.median(dev))))
        keep = dev <= np.median(dev) + OUTLIER_MADS * 1.4826 * mad
        if mad > 0 and keep.sum() >= x.shape[1] and not keep.all():
            res = fit(x[keep], t[keep])
    coef = dict(zip(names, res.coef.tolist()))
    c0 = coef.pop("intercept")
    resid = {f: c for f, c in coef.items() if c}
    if g.any():
        prof.update(graph_ms=c0, graph_ms_per_node=0.0)
    if e.any():
        if g.any():
            c0 = max(0.0, float(np.mean(y[e] - eval_linear(resid, steps.cols, e))))
        prof.update(eager_ms=c0, eager_ms_per_kernel=0.0)
    return prof, resid


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


# ---- output -------------------------------------------------------------------------------------
def write_calibration(cal: Calibration, path: str | Path, checks: dict[str, Any]) -> Path:
    """The profile (sim.cost.save_profile: validated, atomic) and `<stem>.fit.json` beside it."""
    from sim.cost import save_profile

    p = save_profile(path, cal.profile)
    report = {"profile": str(p), "fit": cal.quality, "check": checks, "notes": cal.notes}
    text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    return atomic_file(p.with_name(p.stem + ".fit.json"), text)
