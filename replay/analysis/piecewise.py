"""`replay calibrate`'s piecewise GPU pass models from shape sweeps (fits: replay.analysis.gpufit,
replay.analysis.mixedfit).

`--gpu-model` (GPU_MODELS): `linear` keeps the linear (and max-of-linear) fits of
replay.analysis.calibrate; `piecewise` fits the decode table and the mixed spline from the sweep;
`auto` (default) is piecewise when every sweep file measures whole steps
(replay.analysis.sweepmeta.MEASURES_STEP), else linear, so older sweep files give the profiles they
gave.

Rows (over replay.analysis.calibrate's `joined`: the runs' steps, then the sweep's rows):
- decode: the sweep's decode rows timed as the runs ran decode (graph replays or eager). A sweep
  that measures whole steps is the profile as it is; an older one (forward + logits only) is
  shifted by the median offset of the runs' clean decode steps from the table (the sweep gives
  the surface, the runs its level). The runs' steps do not join the table: the sweep's grid
  covers the envelope, the runs only where the calibration workload went.
- verify: decode rows with drafts (spec verify widths) run another attention kernel
  (engine paged_attention, not decode_attention), so they get their own table (`gpu_pass.verify`,
  no straggler branch: its split rule is decode_attention's) when the sweep has a grid of them.
- mixed: the sweep's mixed rows and the runs' clean mixed steps, as the linear fit takes them.
Active `gpu.*` seed terms are subtracted from the runs' steps first (the sim adds them back).
Held back (heldback.decode_hold / mixed_hold): a refit without those sweep points predicts them;
per region the median and max relative error go into the fit report with a one-line verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.analysis import gpufit, graphsteps, heldback, mixedfit
from replay.analysis.shapes_file import SweepRows
from replay.analysis.steps import CalibrationError, Steps, eval_linear
from replay.analysis.sweepmeta import measures_steps

GPU_MODELS = ("auto", "linear", "piecewise")


@dataclass
class Piecewise:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> gpu_pass model
    fit_rows: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> mask over joined
    report: dict[str, Any] = field(default_factory=dict)  # fit report (quality) entries
    verdict: str = ""


def use_piecewise(mode: str, sweep: SweepRows | None) -> bool:
    if mode not in GPU_MODELS:
        raise CalibrationError(f"--gpu-model {mode!r}: expected one of {list(GPU_MODELS)}")
    if sweep is None:
        if mode == "piecewise":
            raise CalibrationError("--gpu-model piecewise needs a shape sweep (--shapes FILE)")
        return False
    if mode == "auto":
        return all(measures_steps(m) for m in sweep.meta)
    return mode == "piecewise"


def fit_piecewise(
    joined: Steps,
    y: np.ndarray,
    num_run_steps: int,
    sweep: SweepRows,
    decode_rows: np.ndarray,
    mixed_terms: Sequence[str],
    notes: list[str],
) -> Piecewise:
    """`y`: the GPU target over `joined`, active gpu terms already subtracted. `decode_rows`:
    the sweep's decode rows timed as the runs ran decode (a mask over the sweep)."""
    out = Piecewise()
    cols = joined.cols
    n = num_run_steps
    in_sweep = np.arange(len(y)) >= n
    usable = joined.clean & np.isfinite(y) & (y > 0)  # rows are weighted by 1 / y
    drafts = cols["draft_tokens"] > 0
    run_dec = ~in_sweep & (cols["num_prefill_reqs"] == 0) & usable
    run_mix = ~in_sweep & (cols["num_prefill_reqs"] > 0) & usable
    dec = np.concatenate([np.zeros(n, bool), decode_rows])
    mix = np.concatenate([np.zeros(n, bool), ~sweep.decode])
    regions: dict[str, Any] = {}
    whole = all(measures_steps(m) for m in sweep.meta)
    sb = sweep.bucket if sweep.bucket is not None else np.zeros(len(sweep), np.int64)
    steps = _Steps(np.concatenate([np.zeros(n, np.int64), sb]), sweep.graph_buckets())
    _fit_table(out, regions, "decode", cols, y, dec & ~drafts, run_dec & ~drafts, whole, notes,
               steps)  # fmt: skip
    if (dec & drafts).any():  # spec verify widths: another attention kernel, their own table
        _fit_table(out, regions, "verify", cols, y, dec & drafts, run_dec & drafts, whole, notes,
                   steps)  # fmt: skip
    rows = mix | run_mix
    knots = mixedfit.mixed_knots(cols, rows) if mix.any() else None
    if knots is None:
        if mix.any():
            notes.append("gpu_pass.mixed: fewer than 3 token counts in the sweep; kept linear")
    else:
        hold = heldback.mixed_hold(cols, mix)
        held = mixedfit.fit_mixed(cols, y, rows & ~hold, knots, mixed_terms)
        regions.update(_held_errors("mixed", held.model, cols, y, hold))
        fitted = mixedfit.fit_mixed(cols, y, rows, knots, mixed_terms)
        out.models["mixed"], out.fit_rows["mixed"] = fitted.model, rows
        out.report["gpu_pass.mixed.piecewise"] = {**fitted.report, "run_steps": int(run_mix.sum())}
    out.verdict = heldback.verdict(regions)
    out.report["gpu_pass.held_back"] = {
        "every": heldback.HOLD_EVERY,
        "ok_below": heldback.HELD_BACK_OK,
        "regions": regions,
        "verdict": out.verdict,
    }
    return out


@dataclass
class _Steps:
    bucket: np.ndarray  # per joined row: the decode graph's batch size (0: eager, run steps)
    buckets: list[int]  # the engine's graph sizes


def _fit_table(
    out: Piecewise,
    regions: dict[str, Any],
    kind: str,
    cols: dict[str, np.ndarray],
    y: np.ndarray,
    rows: np.ndarray,
    run_rows: np.ndarray,
    whole: bool,
    notes: list[str],
    steps: _Steps,
) -> None:
    """The table of `kind` (decode: plain decode steps, + the straggler branch; verify: decode
    steps with drafts, which run paged_attention, no straggler rule) on the sweep's `rows`,
    stepping where graphs padded its rows (replay.analysis.graphsteps)."""
    segments = graphsteps.padded_segments(cols, rows, steps.bucket, steps.buckets)
    nodes = gpufit.decode_nodes(cols, rows, segments) if rows.any() else None
    if nodes is None:
        what = "kept the linear form" if kind == "decode" else "verify steps use the decode model"
        notes.append(
            f"gpu_pass.{kind}: the sweep has no grid of {kind} rows timed as the runs ran decode "
            f"(2+ batch sizes x 2+ contexts); {what}"
        )
        return
    offset = None if whole else _run_offset(cols, y, run_rows, notes)
    strag_rule = kind == "decode"
    hold = heldback.decode_hold(cols, rows, nodes)
    held = gpufit.fit_decode(cols, y, rows & ~hold, nodes, straggler=strag_rule)
    regions.update(_held_errors(kind, held.model, cols, y, hold))
    fitted = gpufit.fit_decode(cols, y, rows, nodes, offset, straggler=strag_rule)
    out.models[kind], out.fit_rows[kind] = fitted.model, rows
    out.report[f"gpu_pass.{kind}.piecewise"] = fitted.report
    strag, delta = fitted.report["program_keys_ms"], fitted.report["offset_ms"]
    notes.append(
        f"gpu_pass.{kind}: a table over {nodes[0][0]:g}-{nodes[0][-1]:g} query rows x "
        f"{nodes[1][0]:g}-{nodes[1][-1]:g} KV tokens per row from {int(rows.sum())} sweep rows"
        + (f", stepping at {len(nodes.breaks)} padded graph sizes" if nodes.breaks else "")
        + (f", the longest program's branch at {strag * 1e3:.3f} us per key" if strag else "")
        + (f", shifted by the runs' offset {delta:+.3f} ms" if delta else "")
    )


def _run_offset(
    cols: dict[str, np.ndarray], y: np.ndarray, run_dec: np.ndarray, notes: list[str]
) -> Callable[[dict[str, Any]], float] | None:
    """For a sweep of forward + logits only: the median of (clean run step - table) ms."""
    if not run_dec.any():
        notes.append(
            "gpu_pass.decode: the sweep times forward + logits only and no run has clean steps "
            "of the kind to level it with: the table is the sweep's, without the input copy or "
            "sampling"
        )
        return None

    def offset(model: dict[str, Any]) -> float:
        return float(np.median(y[run_dec] - eval_linear(model, cols, run_dec)))

    return offset


def _held_errors(
    kind: str, model: dict[str, Any], cols: dict[str, np.ndarray], y: np.ndarray, hold: np.ndarray
) -> dict[str, Any]:
    if not hold.any():
        return {}
    sub = {k: v[hold] for k, v in cols.items()}
    pred = eval_linear(model, cols, hold)
    return heldback.region_errors(kind, sub, pred, y[hold], np.ones(int(hold.sum()), bool))
