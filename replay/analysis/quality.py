"""Fit quality of a cost profile on runs: per target (GPU pass kind, CPU phase), the time the
sim would predict for each step (base model + active terms, launch table for the launch phase)
against the measured time: R², RMSE, mean and p90 |relative error|, error of the total."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from bubblesim.core.models import get_model
from bubblesim.core.phases import CPU_PHASES, LAUNCH, SAMPLE
from bubblesim.core.runfmt import Run
from replay.analysis.steps import Steps, draft_gpu_ms, eval_linear, load_steps, run_config
from sim.cost import resolve_profile
from sim.cost.defaults import DEFAULTS
from sim.cost.sampling import SAMPLING_KEY, eager_host_ms, mode_of, mode_tables
from sim.cost.terms import TERM_NAMES, term_target


def evaluate(profile: Mapping[str, Any], runs: Sequence[Run], steps: Steps | None = None):
    """Fit statistics of `profile` on `runs`: predicted (as the sim computes it: base model +
    active terms) vs measured time per step, per target."""
    steps = steps or load_steps(runs)
    prof = resolve_profile(profile)
    out: dict[str, Any] = {}
    decode = steps.cols["num_prefill_reqs"] == 0
    gpu_extra = active_terms_ms(prof, steps, "gpu")
    gpu_y = steps.gpu_ms - draft_gpu_ms(runs, steps)
    kinds = [("decode", decode), ("mixed", ~decode)]
    if "verify" in prof["gpu_pass"]:  # spec verify steps have their own model (sim.cost.model)
        drafts = decode & (steps.cols["draft_tokens"] > 0)
        kinds = [("decode", decode & ~drafts), ("mixed", ~decode), ("verify", drafts)]
    for kind, mask in kinds:
        rows = mask & np.isfinite(gpu_y)
        if kind not in prof["gpu_pass"] or not rows.any():
            continue
        pred = eval_linear(prof["gpu_pass"][kind], steps.cols, rows) + gpu_extra[rows]
        out[f"gpu_pass.{kind}"] = stats(pred, gpu_y[rows])
        clean = rows & steps.clean
        if clean.any() and clean.sum() < rows.sum():
            pc = eval_linear(prof["gpu_pass"][kind], steps.cols, clean) + gpu_extra[clean]
            out[f"gpu_pass.{kind}.clean"] = stats(pc, gpu_y[clean])
    for phase, y, rows, pred in phase_predictions(prof, runs, steps):
        out[f"cpu_phases.{phase}"] = stats(pred, y[rows])
    return out


def phase_predictions(
    prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps
) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """Per CPU phase measured at some step: (phase, its measured ms per step (NaN where not
    measured), the measured rows, `phase_predicted_ms` at those rows), in CPU_PHASES order."""
    for phase in CPU_PHASES:
        y = steps.phase_ms[phase]
        rows = np.isfinite(y)
        if rows.any():
            yield phase, y, rows, phase_predicted_ms(prof, runs, steps, phase, rows)


def phase_predicted_ms(
    prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps, phase: str, rows: np.ndarray
) -> np.ndarray:
    """What the sim predicts for `phase` at the steps `rows` of a resolved profile: base model
    + active terms (+ the launch table for the launch phase)."""
    pred = eval_linear(prof["cpu_phases"].get(phase, {}), steps.cols, rows)
    pred += active_terms_ms(prof, steps, phase)[rows]
    if phase == SAMPLE:
        pred += sampling_host_ms(prof, runs, steps)[rows]
    if phase == LAUNCH:
        la = prof["launch"]
        nodes = _nodes(runs, steps, la)
        graph_ms = la["graph_ms"] + la["graph_ms_per_node"] * nodes
        eager_ms = la["eager_ms"] + la["eager_ms_per_kernel"] * nodes
        pred += np.where(steps.graph, graph_ms, eager_ms)[rows]
    return pred


def sampling_host_ms(prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps) -> np.ndarray:
    """Per step, the sample phase's random-sampling term the sim adds (sim.cost.model,
    sim.cost.sampling: a run's sampling mode at the step's sampled rows, on the steps whose
    sampling is outside a graph; not x host_scale); 0 on runs that sample greedily."""
    out = np.zeros(len(steps))
    table = prof.get(SAMPLING_KEY) or DEFAULTS[SAMPLING_KEY]
    for i, run in enumerate(runs):
        cfg = run_config(run)
        sp = cfg.sampling
        vocab = get_model(cfg.model).vocab_size
        tables = mode_tables(table, mode_of(sp.temperature, sp.top_k, sp.top_p, vocab), vocab)
        if tables is None:
            continue
        reqs = steps.cols["num_reqs"]
        spec_k = cfg.spec.k if cfg.spec.enabled else None
        # verification samples after every graph; plain decoding only on eager steps
        charged = (steps.run == i) & (reqs > 0)
        if spec_k is None:
            charged &= ~steps.graph
        out[charged] = [eager_host_ms(tables, int(r), spec_k) for r in reqs[charged]]
    return out


def active_terms_ms(prof: Mapping[str, Any], steps: Steps, target: str) -> np.ndarray:
    all_rows = np.ones(len(steps), bool)
    out = np.zeros(len(steps))
    for t in TERM_NAMES:
        if term_target(t) == target and steps.active[t].any():
            value = eval_linear(prof["terms"][t], steps.cols, all_rows)
            out += np.where(steps.active[t], value, 0.0)
    return out


def _nodes(runs: Sequence[Run], steps: Steps, la: Mapping[str, Any]) -> np.ndarray:
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


def print_quality(title: str, quality: Mapping[str, Any]) -> None:
    print(title)
    print(
        f"  {'target':<32} {'n':>7} {'R²':>7} {'meas ms':>9} {'pred ms':>9} {'|rel err|':>9} "
        f"{'total':>8}"
    )
    for name, q in quality.items():
        if not q.get("n"):
            continue
        r2 = "-" if q["r2"] is None else f"{q['r2']:.3f}"
        rel = "-" if q["mean_abs_rel_error"] is None else f"{100 * q['mean_abs_rel_error']:.1f}%"
        tot = "-" if q["total_rel_error"] is None else f"{100 * q['total_rel_error']:+.1f}%"
        print(
            f"  {name:<32} {q['n']:>7} {r2:>7} {q['measured_mean_ms']:>9.4f} "
            f"{q['predicted_mean_ms']:>9.4f} {rel:>9} {tot:>8}"
        )
