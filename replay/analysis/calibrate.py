"""Fit the simulator's cost profile from measured runs (`python -m replay calibrate`).

Each fit is least squares over the BatchShape fields that steps.parquet records, with
non-negative coefficients (every term is a cost), one linear model per target:
- GPU pass, per batch kind (pure decode / mixed): `GPU_TERMS`, on the "clean" steps only
  (replay.analysis.steps: GPU work began after the host had issued all of it, so the interval holds
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

Shape sweeps (`shapes`, files of `python -m replay shapes`): their rows (clean timings of
synthetic batches, replay.gpu.shapes) join the clean steps of the GPU pass fits, per kind. Mixed
rows always join (the engine runs mixed batches eagerly, as the sweep does); decode rows join when
they were timed the way the runs ran decode (CUDA graph replays or eagerly). The sweep times forward
+ logits only, a run's interval also the input copy, input finishing and sampling: the fit report
compares the two sources (`gpu_pass.<kind>.runs_vs_sweep`: a fit to the sweep alone on the clean
run steps, with the median offset) and notes an offset beyond SOURCE_OFFSET_NOTE. A sweep of
another model, GPU or dtype than the runs is an error.

Decode as the larger of two branches (`_fit_straggler`, docs/cost-model.md): with a sweep whose
decode rows were timed as the runs ran decode, `gpu_pass.decode` becomes `{"max": [bulk,
straggler]}`: bulk is the linear fit above (the KV stream: kv_read_tokens), straggler is the
bulk's other terms + c * program_keys (the longest attention program, sim.cost.splits), c fitted
on the sweep's decode rows the bulk branch under-predicts (the runs of a calibration rarely hold
a long context beside short ones). Sweep decode rows that do not join the decode fit (the
default `shapes_kinds`) are shifted by the sweep's offset, the median of bulk - measured over the
rows the bulk branch explains; rows that join count as run steps (no offset). Reported in
`gpu_pass.decode.straggler`.

Piecewise GPU models (`gpu_model`, replay.analysis.piecewise): with a sweep that measures whole
steps (or `--gpu-model piecewise`), the decode pass becomes a table over query rows x KV tokens per
row (+ the straggler branch) and the mixed pass a spline in num_tokens + linear attention terms,
fitted on the sweep's grid, with held-back grid points reported per region and a verdict. Every
calibration records the envelope its GPU fits measured (profile key `envelope`).

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

from bubblesim.core.config import Config
from bubblesim.core.models import get_model
from bubblesim.core.phases import BROADCAST, CPU_PHASES, LAUNCH, PREPARE_INPUTS, SAMPLE
from bubblesim.core.runfmt import Run, load_run
from replay.analysis.decodetail import MIN_TAIL_KEYS, fit_tail, with_tail
from replay.analysis.eagerlag import describe as describe_eager_lag
from replay.analysis.eagerlag import describe_ranks, eager_ends, fit_eager_lag, fit_rank_launches
from replay.analysis.envelope_runs import (
    ENVELOPE_PHASES,
    check_envelope_runs,
    joined,
    levelled,
    measure_levels,
    relative_weights,
    weighted,
)
from replay.analysis.historyfit import describe as describe_history
from replay.analysis.historyfit import fit_history
from replay.analysis.hostspeed import (
    describe_copula,
    describe_host_speed,
    fit_copula,
    fit_host_speed,
)
from replay.analysis.hostspeed import mean_over as host_mean_over
from replay.analysis.hoststates import describe_host_states, fit_host_states
from replay.analysis.idle_start import fit_idle_start
from replay.analysis.idlegap_file import IdleGapFileError, fit_idle_sweep
from replay.analysis.intake import describe as describe_intake
from replay.analysis.intake import fit_intake
from replay.analysis.level import TOLERANCE as LEVEL_TOLERANCE
from replay.analysis.level import level_curve, scaled_by
from replay.analysis.lsq import fit, numeric_rank
from replay.analysis.outdir import atomic_file
from replay.analysis.piecewise import Piecewise, fit_piecewise, use_piecewise
from replay.analysis.probe import calibration_level
from replay.analysis.quality import (
    active_terms_ms,
    evaluate,
    phase_predicted_ms,
    print_quality,
    stats,
)
from replay.analysis.sampling_file import SamplingFileError, fit_sampling
from replay.analysis.shapes_file import SweepRows, read_sweeps
from replay.analysis.spread import fit_spread
from replay.analysis.steps import (
    CalibrationError,
    Steps,
    draft_gpu_ms,
    eval_linear,
    load_steps,
    mixed_attention,
    program_keys,
    run_config,
    tail_keys,
)
from replay.analysis.sweepmeta import measures_steps
from replay.analysis.syncwake import describe as describe_sync_wake
from replay.analysis.syncwake import fit_sync_wake
from sim.cost import merge_profile, resolve_profile, save_profile, validate_profile
from sim.cost.envelope import ENVELOPE_FIELDS, ranges_of
from sim.cost.hostspeed import HOST_KEY, RHO_KEY
from sim.cost.profile import ALLREDUCE_KEY, MIXED_GRID_KEY, PROBE_KEY, TP_KEY
from sim.cost.sampling import GREEDY, mode_of
from sim.cost.spread import RANKS_KEY, SPREAD_KEY
from sim.cost.terms import BROADCAST_TERM, TERM_NAMES, term_target

__all__ = [
    "CalibrationError",
    "calibrate",
    "evaluate",
    "print_quality",
    "stats",
    "write_calibration",
]

# max_kv_tokens (mixed): attention time also follows the longest context (its programs are the
# step's stragglers), not only the sum of KV tokens; the shape sweep's mixed rows pin it. Not
# for decode: a decode step's time is rather the larger of the KV stream (sum) and the longest
# program (max), which a linear model cannot express (`_fit_straggler` adds that branch from
# a shape sweep), and fitted on Azure-like runs the max
# term extrapolates badly (llama3-8b reasoning decode +44 %, without it -15 %: reports/fidelity).
# Runs recorded before the field have none, and a fit over them drops it (`_recorded_terms`).
GPU_TERMS: dict[str, tuple[str, ...]] = {
    "decode": ("intercept", "num_tokens", "kv_read_tokens", "num_reqs"),
    "mixed": (
        "intercept",
        "num_tokens",
        "kv_read_tokens",
        "max_kv_tokens",
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
# active in all runs keeps its value. Seed 4 before: engine.spec.ngram_cpu runs
# bubblesim.core.ngram in
# Python per request, O(context) (the default is vLLM's numba proposer); seed 3 before: the
# forward list.index scan, O(history).
ONE_SIDED_FIELDS: dict[str, tuple[str, ...]] = {
    "draft.ngram_cpu": ("intercept", "num_reqs", "context_tokens"),
    # the GPU proposer's host launch (its small kernels): bench/spec_parts.py measures it on
    # one host at one time (1.39 ms on an H100), a run's draft phase on its own host (1.20 ms
    # on seed 5's off side, 2026-11-27): that difference is ~15 % of a CPU-bound step, far
    # above the switches (seeds 1, 2, 5) measured with ngram-gpu on both sides
    "draft.ngram_gpu_launch": ("intercept",),
    "sample.forward_placeholder_scan": ("history_tokens",),
}
LAUNCH_RESIDUAL_TERMS = ("num_reqs", "num_tokens")
BROADCAST_FIELDS = ("intercept", "num_reqs", "prefill_tokens")  # a step's inputs to send
OUTLIER_MADS = 5.0  # graph launches this far above the fit (robust sigmas) are one-off uploads
MIN_CLEAN_STEPS = 20
STRAGGLER_START = 1.05  # sweep rows this far above the bulk branch seed the straggler fit
MIN_STRAGGLER_ROWS = 3
SOURCE_OFFSET_NOTE = 0.05  # a median offset of clean run steps from the sweep's fit worth a note
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

    # one-sided terms first, one field at a time (whatever the data can tell apart): a field
    # the term owns is the term's even where a base field says the same on these runs (one
    # request a step: num_reqs is the intercept)
    for t in owned:
        on = steps.active[t][rows].astype(np.float64)
        if not [f for f in owned[t] if try_add(t, [f], on)]:
            y -= on * eval_linear(default_terms[t], steps.cols, rows)
    taken = {f for fields in owned.values() for f in fields}
    for f in base_terms:  # greedy: a field adds a column only if it adds information
        if f not in taken:
            try_add("", [f], None)
    for t in free:
        if t in owned:
            continue
        on = steps.active[t][rows].astype(np.float64)
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
    quality: dict[str, Any]  # target -> fit statistics on the calibration runs (and sweeps)
    notes: list[str]
    shapes: list[str] = field(default_factory=list)  # shape sweep files used
    verdict: str = ""  # held-back sweep points, one line (piecewise GPU models only)
    spread: dict[str, Any] = field(default_factory=dict)  # cpu_spread fit report, per phase
    host_speed: dict[str, Any] = field(default_factory=dict)  # host_speed fit report


def _fit_cpu_phases(
    runs: Sequence[Run],
    steps: Steps,
    dterms: Mapping[str, Mapping[str, float]],
    one_sided: Mapping[str, Sequence[str]] | None,
    fitted_terms: dict[str, dict[str, float]],
) -> tuple[dict[str, dict[str, float]], np.ndarray | None]:
    """Each CPU phase's base model (its fitted seed terms into `fitted_terms`), and the sample
    phase's penalised spec rows (None without a sample phase), which its fit leaves to
    `history_host`."""
    cpu: dict[str, dict[str, float]] = {}
    pen_rows: np.ndarray | None = None
    for phase, base_terms in PHASE_TERMS.items():
        y = steps.phase_ms[phase]
        rows = np.isfinite(y)
        if phase == SAMPLE:
            pen_rows = rows & _penalised_spec(runs, steps)
            rows &= ~pen_rows  # their penalties' host work is `history_host`
        if not rows.any():
            continue
        tf = fit_target(steps, y, rows, base_terms, phase, dterms, one_sided)
        cpu[phase] = tf.model
        fitted_terms.update(tf.terms)
    return cpu, pen_rows


def _with_envelope(
    runs: Sequence[Run],
    steps: Steps,
    env_runs: Sequence[Run],
    cpu: dict[str, dict[str, float]],
    dterms: Mapping[str, Mapping[str, float]],
    one_sided: Mapping[str, Sequence[str]] | None,
    fitted_terms: dict[str, dict[str, float]],
    notes: list[str],
) -> dict[str, dict[str, float]]:
    """The envelope phases refitted on the plain (no speculative decoding) calibration steps +
    the envelope runs' steps, each run levelled to the calibration's fit, on relative errors
    (replay.analysis.envelope_runs). Fields no plain step holds (draft_tokens) and the seed terms
    of speculative decoding keep the calibration's fit; the penalised spec steps `history_host`
    reads are spec steps, so the refit never reads them."""
    check_envelope_runs(runs, env_runs)
    env = load_steps(env_runs)
    levels = measure_levels(steps, env, env_runs, cpu, fitted_terms, dterms)
    both = joined(steps, levelled(env, levels), len(runs))
    spec = np.array([run_config(r).spec.enabled for r in runs], bool)
    plain = np.concatenate([~spec[steps.run], np.ones(len(env), bool)])
    out = dict(cpu)
    for phase in ENVELOPE_PHASES:
        rows = np.isfinite(both.phase_ms[phase]) & plain
        w = relative_weights(both, cpu[phase], rows)
        fit_on = weighted(both, w)
        tf = fit_target(fit_on, fit_on.phase_ms[phase], rows, PHASE_TERMS[phase], phase, dterms,
                        one_sided)  # fmt: skip
        absent = [f for f in PHASE_TERMS[phase] if f in cpu[phase] and not both.cols[f][rows].any()]
        out[phase] = {**tf.model, **{f: cpu[phase][f] for f in absent}}
        fitted_terms.update(tf.terms)
    for lv in levels:
        notes.append("cpu_phases: envelope run " + lv.describe())
    return out


def _penalised_spec(runs: Sequence[Run], steps: Steps) -> np.ndarray:
    """bool per step: a step with history rows in a speculative-decoding run whose sampling
    has penalties: the verify path applies them eagerly (`history_host`)."""
    pen = np.array(
        [(c := run_config(r)).sampling.has_penalties and c.spec.enabled for r in runs], bool
    )
    return pen[steps.run] & (steps.cols["history_tokens"] > 0)


def _fit_history_host(
    runs: Sequence[Run], steps: Steps, fitted: Mapping[str, Any], pen: np.ndarray,
    notes: list[str],
) -> dict[str, float]:  # fmt: skip
    """`history_host`: the median excess of `sample` over what `fitted` (its base model and
    terms, fitted without the steps `pen`) predicts for those steps."""
    model_ms = phase_predicted_ms(fitted, runs, steps, SAMPLE, pen)
    extra = max(0.0, float(np.median(steps.phase_ms[SAMPLE][pen] - model_ms)))
    notes.append(
        f"history_host.spec_sample_ms: {extra:.3f} ms (median excess of `sample` over its "
        f"model on {int(pen.sum())} spec steps with penalised rows)"
    )
    return {"spec_sample_ms": extra}


def _recorded_terms(
    gterms: Mapping[str, Sequence[str]], runs: Sequence[Run], notes: list[str]
) -> dict[str, tuple[str, ...]]:
    """The GPU terms without shape fields some run did not record (`Run.filled`: zeros stand in
    for them, which a fit would read as measurements)."""
    missing = sorted({c for r in runs for c in getattr(r, "filled", ())})
    if missing:
        notes.append(f"gpu_pass: {missing} not recorded by every run; left out of the GPU fits")
    return {k: tuple(t for t in v if t not in missing) for k, v in gterms.items()}


def calibrate(
    run_dirs: Sequence[str | Path],
    gpu_terms: Mapping[str, Sequence[str]] | None = None,
    gpu_preset: str | None = None,
    base: Mapping[str, Any] | None = None,
    one_sided: Mapping[str, Sequence[str]] | None = None,
    shapes: Sequence[str | Path] = (),
    shapes_kinds: Sequence[str] = ("mixed",),
    gpu_model: str = "auto",
    spread: bool = True,
    host_speed: bool = True,
    host_copula: bool = False,
    host_states: bool = False,
    idle_sweeps: Sequence[str | Path] = (),
    sampling_sweep: str | Path | None = None,
    envelope: Sequence[str | Path] = (),
) -> Calibration:
    """`base`: the (partial) profile the fit is used with: its terms are the values held fixed
    (default: the built-in defaults). `one_sided`: see ONE_SIDED_FIELDS. `shapes`: shape sweep
    files whose rows join the GPU pass fits (module docstring); `shapes_kinds`: the batch kinds
    whose sweep rows may join the linear fits (the others are only reported). `gpu_model`:
    replay.analysis.piecewise.GPU_MODELS (auto: piecewise for sweeps that measure whole steps).
    `spread`: fit the CPU phases' spread around the fitted models (`cpu_spread`,
    replay.analysis.spread). `host_speed` (with `spread`): fit the host's slowly varying speed
    and the phases' spread around it (`host_speed`, replay.analysis.hostspeed). `host_copula`
    (with `host_speed`): also fit `host_speed.rho`, the simulator's copula of the phases'
    top-level tables and the host's state (replay.analysis.hostspeed.fit_copula). `host_states`
    (with `host_speed`, not with `host_copula`): the host's speed as two states with the
    processes' wander within them (`host_speed.states`, replay.analysis.hoststates; where the
    runs show no two states, the processes alone, as without it). `idle_sweeps`:
    `replay idlegap` files; the idle-start laws they give replace the ones the runs give
    (replay.analysis.idlegap_file), which are still reported. `sampling_sweep`: a `replay
    sampling` file: the profile's `sampling` table (random sampling's cost over greedy,
    sim.cost.sampling) from it; without it the profile takes the defaults'. `envelope`: run
    folders whose steps join the CPU phase fits only, levelled to the runs' host
    (replay.analysis.envelope_runs); the profile lists them as `envelope_runs`."""
    runs = [load_run(d) for d in run_dirs]
    env_runs = [load_run(d) for d in envelope]
    if not runs:
        raise CalibrationError("calibrate needs at least one run folder")
    identity, notes = _identity(runs, gpu_preset)
    sweep = _load_sweeps(shapes, runs) if shapes else None
    history: dict[str, Any] | None = None  # gpu_pass.history from the sweeps' history rows
    history_report: dict[str, Any] | None = None
    if sweep is not None and sweep.history().any():
        history, history_report = fit_history(sweep)
        notes.append(describe_history(history_report))
        sweep = sweep.subset(~sweep.history())  # the other fits never see the penalties
    piecewise = use_piecewise(gpu_model, sweep)
    if sweep is not None:
        identity["notes"] += f" + {len(sweep.paths)} shape sweep(s) of {len(sweep)} rows"
    steps = load_steps(runs)
    defaults = resolve_profile(base)
    dterms = defaults["terms"]
    gterms = _recorded_terms({**GPU_TERMS, **(gpu_terms or {})}, runs, notes)
    prof: dict[str, Any] = {
        "version": defaults["version"],
        **identity,
        "source_runs": [str(r.path) for r in runs],
        **({"envelope_runs": [str(r.path) for r in env_runs]} if env_runs else {}),
    }
    fitted_terms: dict[str, dict[str, float]] = {}
    # GPU pass, per kind: the clean steps of the runs (+ the sweeps' rows that join)
    gpu_y = steps.gpu_ms - draft_gpu_ms(runs, steps)
    decode = steps.cols["num_prefill_reqs"] == 0
    joined, joined_y = _join(steps, gpu_y, sweep)
    joins = _sweep_joins(sweep, runs, shapes_kinds, notes) if sweep is not None else None
    gp: dict[str, Any] = {}
    fit_rows: dict[str, np.ndarray] = {}  # kind -> mask over `joined`
    for kind, mask in (("decode", decode), ("mixed", ~decode)):
        keep = "the base profile's" if kind in (base or {}).get("gpu_pass", {}) else "the roofline"
        have = mask & np.isfinite(gpu_y)
        clean = have & steps.clean
        take = np.zeros(0, bool)
        if sweep is not None and joins is not None:
            take = joins & (sweep.decode == (kind == "decode"))
        if not have.any() and not take.any():
            notes.append(f"gpu_pass.{kind}: no steps of this kind; keeping {keep}")
            continue
        if clean.sum() + take.sum() < max(MIN_CLEAN_STEPS, 3 * len(gterms[kind])):
            # the other intervals are paced by an eager launch or the host: fitted as kernels,
            # they would come back in the sim twice (the sim adds the launch bound itself) and
            # stay when a switch removes the host work (a graph launch, a shorter phase)
            more = f" (+ {int(take.sum())} shape sweep rows)" if sweep is not None else ""
            notes.append(
                f"gpu_pass.{kind}: only {int(clean.sum())} of {int(have.sum())} steps hold "
                f"kernels alone (the rest wait on the launch or the host){more}; keeping {keep}"
            )
            continue
        rows = np.concatenate([clean, take])
        gp[kind] = fit_target(joined, joined_y, rows, gterms[kind], "gpu", dterms).model
        fit_rows[kind] = rows
    straggler: dict[str, Any] = {}
    recorded = not any("max_kv_tokens" in getattr(r, "filled", ()) for r in runs)
    if "decode" in gp and sweep is not None and recorded and not piecewise:
        joins_dec = joins is not None and bool((joins & sweep.decode).any())
        gp["decode"], straggler = _fit_straggler(gp["decode"], sweep, runs, joins_dec, notes)
    pw = Piecewise()
    if piecewise and sweep is not None:
        y_less = joined_y - active_terms_ms(defaults, joined, "gpu")
        dec_rows = _graph_matched_decode(sweep, runs) if recorded else np.zeros(len(sweep), bool)
        pw = fit_piecewise(joined, y_less, len(steps), sweep, dec_rows, gterms["mixed"], notes)
        gp.update(pw.models)
        fit_rows.update(pw.fit_rows)
        if "decode" in pw.models:  # the runs' mixed contexts, then their level
            tail, tail_report = fit_tail(runs, gp["decode"])
            if tail is not None:
                gp["decode"] = with_tail(gp["decode"], tail)
                notes.append(
                    f"gpu_pass.decode: tail_keys {tail * 1e3:.3f} us per key (median of "
                    f"{tail_report['steps']} clean queued decode steps of the runs with >= "
                    f"{MIN_TAIL_KEYS} tail keys; p10 {tail_report['p10'] * 1e3:.3f}, p90 "
                    f"{tail_report['p90'] * 1e3:.3f})"
                )
            curve, level_report = level_curve(runs, gp["decode"])
            if curve is not None and not curve.is_flat_within(LEVEL_TOLERANCE):
                gp["decode"] = scaled_by(gp["decode"], curve)
                notes.append(
                    f"gpu_pass.decode: levelled to {level_report['steps']} clean queued decode "
                    f"steps of the runs, by batch band (median measured/sweep): "
                    f"{curve.describe()}"
                )
    if gp:
        prof["gpu_pass"] = gp
        prof["envelope"] = _envelope(joined, fit_rows, gp)
    if history is not None:
        prof.setdefault("gpu_pass", {})["history"] = history
    # CPU phases (with envelope runs: refitted on their levelled steps too)
    cpu, pen = _fit_cpu_phases(runs, steps, dterms, one_sided, fitted_terms)
    if env_runs:
        cpu = _with_envelope(runs, steps, env_runs, cpu, dterms, one_sided, fitted_terms, notes)
    if pen is not None and pen.sum() >= MIN_CLEAN_STEPS:
        fitted = {"cpu_phases": {SAMPLE: cpu[SAMPLE]}, "terms": {**dterms, **fitted_terms}}
        prof["history_host"] = _fit_history_host(runs, steps, fitted, pen, notes)
    launch_prof, launch_model = _fit_launch(steps)
    if launch_prof:
        prof["launch"] = launch_prof
        cpu[LAUNCH] = launch_model
    if cpu:
        prof["cpu_phases"] = {p: cpu[p] for p in CPU_PHASES if p in cpu}
    bcast = _fit_broadcast(runs, steps, notes)
    if bcast is not None:
        fitted_terms[BROADCAST_TERM] = bcast
    if fitted_terms:
        prof["terms"] = fitted_terms
        notes.append("fitted seed terms: " + ", ".join(fitted_terms))
    gc = _fit_gc(runs, defaults["gc"])
    if gc:
        prof["gc"] = gc
    validate_profile(prof)
    # host timings read straight off the runs' records: a table (or None: keep the base) and
    # the note that says what it rests on
    for key, fitter, describe in (
        ("sync_wait", fit_sync_wake, describe_sync_wake),
        ("intake", fit_intake, describe_intake),
    ):
        table, report = fitter(runs)
        if table is not None:
            prof[key] = table
            notes.append(describe(table, report))
    used = merge_profile(base, prof) if base else prof
    idle, idle_report = fit_idle_start(runs, used)  # needs the fitted decode pass
    if idle_sweeps:
        idle = idle_from_sweeps(idle_sweeps, identity["model"], idle, notes)
    if idle is not None:
        prof.setdefault("gpu_pass", {})["idle_start"] = idle
        used = merge_profile(base, prof) if base else prof
        ir = idle_report
        if "note" in ir:
            notes.append(f"gpu_pass.idle_start (decode): {ir['note']}")
        if "verify_note" in ir:
            notes.append(f"gpu_pass.idle_start (verify): {ir['verify_note']}")
        if "shrink_per_ms" in ir:
            notes.append(
                f"gpu_pass.idle_start: a graph issued to an idle GPU saves "
                f"min({ir['shrink_per_ms']:.2f} x (idle - {ir['shrink_after_ms']:.3f} ms), "
                f"{ir['shrink_max_fraction']:.2f} x pass), from {ir['steps']} decode graph "
                f"steps (idle p10 {ir['idle_ms_p10']:.2f}, p90 {ir['idle_ms_p90']:.2f} ms); "
                f"median |error| {ir['abs_err_ms_law']:.3f} ms (one ratio {ir['scale']:.3f}: "
                f"{ir['abs_err_ms_ratio']:.3f} ms; none: {ir['abs_err_ms_none']:.3f} ms)"
            )
        if "verify_shrink_per_ms" in ir:
            notes.append(
                f"gpu_pass.idle_start: verify graphs save min({ir['verify_shrink_per_ms']:.2f} "
                f"x (idle - {ir['verify_shrink_after_ms']:.3f} ms), "
                f"{ir['verify_shrink_max_fraction']:.2f} x pass), from {ir['verify_steps']} "
                f"steps (measured/sweep median {ir['verify_ratio']:.3f}); median |error| "
                f"{ir['verify_abs_err_ms_law']:.3f} ms (none: {ir['verify_abs_err_ms_none']:.3f})"
            )
    spread_report: dict[str, Any] = {}
    if spread:  # around the fitted models: last, on the profile the sim will use
        tables, spread_report = fit_spread(resolve_profile(used), runs, steps, notes)
        if tables:
            prof[SPREAD_KEY] = tables
            used = merge_profile(base, prof) if base else prof
    host_report: dict[str, Any] = {}
    if spread and host_speed:  # the same predictions: cpu_spread changes none of them
        resolved = resolve_profile(used)
        hs = None
        if host_states:
            hs, speed, host_report = fit_host_states(resolved, runs, steps, notes)
        if hs is None:
            hs, speed, host_report = fit_host_speed(resolved, runs, steps, notes)
        if hs is not None:
            around, _ = fit_spread(resolved, runs, steps, [], speed)
            over, waited = host_mean_over(runs)
            prof[HOST_KEY] = {**hs, **({SPREAD_KEY: around} if around else {}),
                              "mean_over": over}  # fmt: skip
            describe = describe_host_states if "states" in hs else describe_host_speed
            notes.append(describe(host_report))
            notes.append(f"host_speed.mean_over: {over} (the runs' CPU waited on the GPU "
                         f"{100 * waited:.0f} % of their span)")  # fmt: skip
            if host_copula:  # the phases' tables at quantiles correlated with the host
                rho, host_report["copula"] = fit_copula(resolved, runs, steps, host_report, notes)
                prof[HOST_KEY][RHO_KEY] = rho
                notes.append(describe_copula(host_report["copula"]))
            used = merge_profile(base, prof) if base else prof
    # after the GPU fits: the eager steps are classified by their predicted kernels
    ends = eager_ends(runs, steps, resolve_profile(used))
    tp = int(identity.get(TP_KEY, 1)) > 1
    ranks_fit = None
    if tp:  # where the worker ranks' eager launches end
        ranks_fit, ranks_report = fit_rank_launches(ends)
        notes.append(describe_ranks(ranks_report))
        if ranks_fit is not None:
            prof[RANKS_KEY] = ranks_fit
            used = merge_profile(base, prof) if base else prof
    if tp and ranks_fit is None and (SPREAD_KEY in prof or HOST_KEY in prof):
        # the other ranks' eager launches, drawn from the fitted launch spread, make it
        lag = None
        notes.append(
            "launch.eager_lag_ms: not fitted with tensor parallelism and a fitted spread "
            "(the simulator draws the other ranks' eager launches from it)"
        )
    else:
        lag, lag_report = fit_eager_lag(ends)
        notes.append(describe_eager_lag(lag_report))
    if lag is not None:
        prof.setdefault("launch", {})["eager_lag_ms"] = lag
        used = merge_profile(base, prof) if base else prof
    probe = calibration_level(runs, resolve_profile(used))
    if probe is not None:  # the calibration host's level, for a target host's host_scale
        prof[PROBE_KEY] = probe
        notes.append(f"host_probe: level {probe['level']:.3f} (measured / predicted CPU time "
                     f"over the probes of {probe['runs']} run(s))")  # fmt: skip
    if sampling_sweep is not None:  # the runs sample greedily: nothing above reads it
        try:
            vocab = get_model(identity["model"]).vocab_size
            prof.update(fit_sampling(sampling_sweep, vocab))
        except SamplingFileError as e:
            raise CalibrationError(str(e)) from None
        notes.append(f"sampling: random sampling's cost over greedy from {sampling_sweep}")
        used = merge_profile(base, prof) if base else prof
    quality = evaluate(used, runs, steps)
    quality.update(_gpu_fit_quality(used, joined, joined_y, fit_rows, len(steps)))
    if straggler:
        quality["gpu_pass.decode.straggler"] = straggler
    if sweep is not None:
        quality.update(_sweep_quality(used, steps, gpu_y, sweep, gterms, dterms, notes))
    quality.update(pw.report)
    if history_report is not None:
        quality["gpu_pass.history"] = history_report
    paths = list(sweep.paths) if sweep is not None else []
    return Calibration(prof, quality, notes, paths, pw.verdict, spread_report, host_report)


def _envelope(
    joined: Steps, fit_rows: Mapping[str, np.ndarray], gp: Mapping[str, Any]
) -> dict[str, Any]:
    """Per fitted kind, the ranges of sim.cost.envelope's fields over the rows it was fitted on
    (a kind kept from the base profile or the roofline has none)."""
    out: dict[str, Any] = {}
    for kind, rows in fit_rows.items():
        if kind in gp and rows.any():
            fields = tuple(f for f in ENVELOPE_FIELDS if kind == "mixed" or f != "prefill_tokens")
            out[kind] = ranges_of(joined.cols, rows, fields)
    return out


# ---- shape sweeps -------------------------------------------------------------------------------
def _load_sweeps(paths: Sequence[str | Path], runs: Sequence[Run]) -> SweepRows:
    """The sweeps' rows; each file must be of the runs' model, dtype and GPU."""
    sweep = read_sweeps(paths)
    cfg = run_config(runs[0])
    want = {
        "model": cfg.model,
        "dtype": cfg.dtype,
        "gpu": _gpu_name(runs[0], cfg),
        TP_KEY: cfg.tensor_parallel_size,
    }
    for path, meta in zip(sweep.paths, sweep.meta):
        got = {k: meta.get(k, 1 if k == TP_KEY else None) for k in want}
        if got != want:
            bad = [k for k in want if got[k] != want[k]]
            raise CalibrationError(
                f"shapes file '{path}' is of another {'/'.join(bad)} than the runs: "
                + ", ".join(f"{k} {got[k]!r} (runs: {want[k]!r})" for k in bad)
                + "; calibrate one model, GPU, dtype and tensor_parallel_size at a time"
            )
    sweep.cols["program_keys"] = program_keys(
        runs[0], sweep.cols["num_reqs"], sweep.cols["max_kv_tokens"]
    )
    sweep.cols["tail_keys"] = tail_keys(
        runs[0], sweep.cols["num_reqs"], sweep.cols["kv_read_tokens"], sweep.cols["max_kv_tokens"]
    )
    sweep.cols.update(mixed_attention(runs[0], sweep.cols))
    return sweep


def _graph_matched_decode(sweep: SweepRows, runs: Sequence[Run]) -> np.ndarray:
    """The sweep's decode rows timed as every run ran decode (CUDA graph replays or eagerly)."""
    graphed = {c.cuda_graphs and c.device == "cuda" for c in (run_config(r) for r in runs)}
    if len(graphed) > 1:
        return np.zeros(len(sweep), bool)
    return sweep.decode & (sweep.graph == graphed.pop())


def _fit_straggler(
    bulk: Mapping[str, float],
    sweep: SweepRows,
    runs: Sequence[Run],
    joined: bool,
    notes: list[str],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`{"max": [bulk, straggler]}` and its report, or (bulk, {}) where the sweep cannot tell.

    straggler = bulk without kv_read_tokens + c * program_keys: the step's non-attention work
    plus the longest program's walk instead of the KV stream. Hinge fit: seed the straggler rows
    with the sweep decode rows measured above STRAGGLER_START x bulk (after the offset), fit c on
    them (non-negative least squares through 0), take as straggler rows those where that branch
    is the larger, and repeat until the rows (and the offset) stop changing."""
    rows = _graph_matched_decode(sweep, runs)
    keys = sweep.cols["program_keys"][rows]
    if not rows.any() or not keys.any() or "kv_read_tokens" not in bulk:
        return dict(bulk), {}
    y = sweep.gpu_ms[rows]
    every = np.ones(int(rows.sum()), bool)
    cols = {k: v[rows] for k, v in sweep.cols.items()}
    base = {t: c for t, c in bulk.items() if t != "kv_read_tokens"}
    pred_bulk = eval_linear(bulk, cols, every)
    pred_base = eval_linear(base, cols, every)

    def offset(mask: np.ndarray) -> float:
        return 0.0 if joined or not mask.any() else float(np.median(pred_bulk[mask] - y[mask]))

    delta = offset(every)
    strag = y + delta > STRAGGLER_START * pred_bulk
    c = 0.0
    for _ in range(50):
        if strag.sum() < MIN_STRAGGLER_ROWS:
            break
        c = float(fit(keys[strag][:, None], (y + delta - pred_base)[strag]).coef[0])
        new = pred_base + c * keys > pred_bulk
        new_delta = offset(~new)
        if (new == strag).all() and new_delta == delta:
            break
        strag, delta = new, new_delta
    if strag.sum() < MIN_STRAGGLER_ROWS or c <= 0:
        notes.append(
            f"gpu_pass.decode: {int(strag.sum())} of the sweep's {int(rows.sum())} decode rows "
            "run above the KV-stream fit; kept it linear (no straggler branch)"
        )
        return dict(bulk), {}
    model = {"max": [dict(bulk), {**base, "program_keys": c}]}
    pred = np.maximum(pred_bulk, pred_base + c * keys)
    report = {
        "program_keys_ms": c,
        "sweep_offset_ms": delta,
        "sweep_rows": int(rows.sum()),
        "straggler_rows": int(strag.sum()),
        "sweep_bulk_only": stats(pred_bulk - delta, y),
        "sweep_max": stats(pred - delta, y),
    }
    notes.append(
        f"gpu_pass.decode: the larger of the KV-stream fit and the longest program "
        f"({c * 1e3:.3f} us per key of program_keys, from {int(strag.sum())} of "
        f"{int(rows.sum())} sweep decode rows, sweep offset {delta:+.3f} ms)"
    )
    return model, report


def _sweep_joins(
    sweep: SweepRows, runs: Sequence[Run], kinds: Sequence[str], notes: list[str]
) -> np.ndarray:
    """Which sweep rows join the fits: of `kinds`, mixed rows (eager, as in the engine) and
    decode rows timed as the runs ran decode (CUDA graph replays or eagerly)."""
    bad = [k for k in kinds if k not in GPU_TERMS]
    if bad:
        raise CalibrationError(f"shape kinds {bad}: expected some of {list(GPU_TERMS)}")
    if "decode" not in kinds:
        return ~sweep.decode if "mixed" in kinds else np.zeros(len(sweep), bool)
    if "mixed" not in kinds:
        return _sweep_joins(sweep, runs, ("decode", "mixed"), notes) & sweep.decode
    cfgs = [run_config(r) for r in runs]
    graphed = {c.cuda_graphs and c.device == "cuda" for c in cfgs}
    joins = ~sweep.decode
    n_dec = int(sweep.decode.sum())
    if len(graphed) > 1:
        if n_dec:
            notes.append(
                f"gpu_pass.decode: some runs replay CUDA graphs, others run decode eagerly: the "
                f"sweeps' {n_dec} decode rows are reported (gpu_pass.decode.shapes), not fitted"
            )
        return joins
    runs_graph = graphed.pop()
    same = sweep.decode & (sweep.graph == runs_graph)
    other = n_dec - int(same.sum())
    if other:
        how = ("eagerly", "as CUDA graph replays")
        notes.append(
            f"gpu_pass.decode: {other} sweep decode rows were timed {how[not runs_graph]} but the "
            f"runs ran decode {how[runs_graph]}: reported (gpu_pass.decode.shapes), not fitted"
        )
    return joins | same


def _join(steps: Steps, y: np.ndarray, sweep: SweepRows | None) -> tuple[Steps, np.ndarray]:
    """The runs' steps followed by the sweeps' rows (clean, no CPU phases, no terms active;
    run index -1 - file), and the GPU target of both."""
    if sweep is None:
        return steps, y
    n = len(sweep)
    missing = [k for k in steps.cols if k not in sweep.cols]
    if missing:
        raise CalibrationError(f"shapes file(s) {sweep.paths}: no column(s) {missing}")
    joined = Steps(
        cols={k: np.concatenate([v, sweep.cols[k]]) for k, v in steps.cols.items()},
        phase_ms={p: np.concatenate([v, np.full(n, np.nan)]) for p, v in steps.phase_ms.items()},
        gpu_ms=np.concatenate([steps.gpu_ms, sweep.gpu_ms]),
        clean=np.concatenate([steps.clean, np.ones(n, bool)]),
        graph=np.concatenate([steps.graph, sweep.graph]),
        run=np.concatenate([steps.run, -1 - sweep.file]),
        active={t: np.concatenate([a, np.zeros(n, bool)]) for t, a in steps.active.items()},
    )
    return joined, np.concatenate([y, sweep.gpu_ms])


def _gpu_fit_quality(
    prof: Mapping[str, Any],
    joined: Steps,
    y: np.ndarray,
    fit_rows: Mapping[str, np.ndarray],
    num_run_steps: int,
) -> dict[str, Any]:
    """`gpu_pass.<kind>.fitted_on`: the fitted model on exactly the rows it was fitted on, with
    how many came from the runs' clean steps and how many from shape sweeps."""
    p = resolve_profile(prof)
    extra = active_terms_ms(p, joined, "gpu")
    out: dict[str, Any] = {}
    for kind, rows in fit_rows.items():
        pred = eval_linear(p["gpu_pass"][kind], joined.cols, rows) + extra[rows]
        q = stats(pred, y[rows])
        q["run_steps"] = int(rows[:num_run_steps].sum())
        q["shape_rows"] = int(rows[num_run_steps:].sum())
        out[f"gpu_pass.{kind}.fitted_on"] = q
    return out


def _sweep_quality(
    prof: Mapping[str, Any],
    steps: Steps,
    gpu_y: np.ndarray,
    sweep: SweepRows,
    gterms: Mapping[str, Sequence[str]],
    dterms: Mapping[str, Mapping[str, float]],
    notes: list[str],
) -> dict[str, Any]:
    """Per kind: `gpu_pass.<kind>.shapes`, the profile on every sweep row of the kind (fitted
    or not); `gpu_pass.<kind>.runs_vs_sweep`, a fit to the sweep rows alone predicting the
    runs' clean steps, with the median offset (measured - predicted) in ms and relative: what
    a run's interval holds beyond the sweep's forward + logits, or a mismatch of the two."""
    p = resolve_profile(prof)
    out: dict[str, Any] = {}
    extra = active_terms_ms(p, steps, "gpu")
    decode = steps.cols["num_prefill_reqs"] == 0
    all_sweep = np.ones(len(sweep), bool)
    drafts = sweep.decode & (sweep.cols["draft_tokens"] > 0)
    if "verify" in p["gpu_pass"] and drafts.any():  # verify rows: the verify model's (shapes)
        pred = eval_linear(p["gpu_pass"]["verify"], sweep.cols, drafts)
        out["gpu_pass.verify.shapes"] = stats(pred, sweep.gpu_ms[drafts])
    for kind in ("decode", "mixed"):
        mine = sweep.decode == (kind == "decode")
        if kind == "decode" and "verify" in p["gpu_pass"]:
            mine &= ~drafts
        if not mine.any():
            continue
        if kind in p["gpu_pass"]:
            pred = eval_linear(p["gpu_pass"][kind], sweep.cols, mine)
            out[f"gpu_pass.{kind}.shapes"] = stats(pred, sweep.gpu_ms[mine])
        clean = (decode if kind == "decode" else ~decode) & np.isfinite(gpu_y) & steps.clean
        if not clean.any() or mine.sum() < len(gterms[kind]) + 2:
            continue
        alone = Steps(
            cols=sweep.cols,
            phase_ms={},
            gpu_ms=sweep.gpu_ms,
            clean=all_sweep,
            graph=sweep.graph,
            run=-1 - sweep.file,
            active={t: np.zeros(len(sweep), bool) for t in steps.active},
        )
        model = fit_target(alone, sweep.gpu_ms, mine, gterms[kind], "gpu", dterms).model
        pred = eval_linear(model, steps.cols, clean) + extra[clean]
        meas = gpu_y[clean]
        q = stats(pred, meas)
        q["offset_ms"] = float(np.median(meas - pred))
        q["offset_rel"] = float(np.median((meas - pred) / meas))
        out[f"gpu_pass.{kind}.runs_vs_sweep"] = q
        if abs(q["offset_rel"]) > SOURCE_OFFSET_NOTE:
            why = (
                "the sweep measures whole steps: the two sources disagree"
                if all(measures_steps(m) for m in sweep.meta)
                else "the sweep times forward + logits; a run's interval also holds the input "
                "copy, input finishing and sampling"
            )
            notes.append(
                f"gpu_pass.{kind}: the {q['n']} clean run steps take {q['offset_ms']:+.3f} ms "
                f"({100 * q['offset_rel']:+.1f} %, median) against a linear fit to the shape "
                f"sweep alone ({why})"
            )
    return out


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


def _broadcast_ms(run: Run) -> np.ndarray:
    """Per step, rank 0's send of the step's inputs (bubblesim.core.phases.BROADCAST): its own phase
    columns where the run format has them, else the time between prepare_inputs' end and the
    launch's start (0 where the engine times the send inside `launch`, which then holds it)."""
    s = run.arrays("steps")
    if f"{BROADCAST}_start_s" in s:
        return (s[f"{BROADCAST}_end_s"] - s[f"{BROADCAST}_start_s"]) * 1e3
    return (s[f"{LAUNCH}_start_s"] - s[f"{PREPARE_INPUTS}_end_s"]) * 1e3


def _fit_broadcast(runs: Sequence[Run], steps: Steps, notes: list[str]) -> dict[str, float] | None:
    """The term `launch.tp_broadcast` of tensor-parallel runs (sim.cost.terms): a non-negative
    fit over BROADCAST_FIELDS of _broadcast_ms; None for one-GPU runs."""
    if run_config(runs[0]).tensor_parallel_size == 1:
        return None
    y = np.concatenate([_broadcast_ms(r) for r in runs])
    rows = np.isfinite(y)
    if rows.sum() < MIN_CLEAN_STEPS:
        notes.append(f"{BROADCAST_TERM}: {int(rows.sum())} steps with a send; keeping the default")
        return None
    x = np.column_stack([steps.cols[f][rows] for f in BROADCAST_FIELDS])
    coef = fit(x, np.maximum(y[rows], 0.0)).coef
    model = {f: float(c) for f, c in zip(BROADCAST_FIELDS, coef) if c}
    notes.append(
        f"{BROADCAST_TERM}: {int(rows.sum())} steps, median {float(np.median(y[rows])):.4f} ms "
        "(between prepare_inputs and launch; 0 when the engine times the send inside launch)"
    )
    return model


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


def _identity(runs: Sequence[Run], gpu_preset: str | None) -> tuple[dict[str, Any], list[str]]:
    """gpu (preset name), model, dtype, mixed_grid, tensor_parallel_size and tp_allreduce (above
    1), date, notes for the profile; all runs must agree."""
    cfgs = [run_config(r) for r in runs]
    for key in ("model", "dtype", TP_KEY, ALLREDUCE_KEY):
        vals = sorted({str(getattr(c, key)) for c in cfgs})
        if len(vals) > 1:
            raise CalibrationError(f"the runs mix {key}s {vals}: calibrate one {key} at a time")
    for r, c in zip(runs, cfgs):  # the fits below take every step's sampling as greedy's
        sp = c.sampling
        mode = mode_of(sp.temperature, sp.top_k, sp.top_p, get_model(c.model).vocab_size)
        if mode != GREEDY:
            raise CalibrationError(
                f"{r.path}: a run that samples at random ({mode}): calibrate from greedy runs "
                "(temperature 0); random sampling's cost comes from a sampling sweep "
                "(`replay sampling`, calibrate --sampling-sweep)"
            )
    names = sorted({_gpu_name(r, c) for r, c in zip(runs, cfgs)})
    if len(names) > 1:
        raise CalibrationError(f"the runs come from different GPUs {names}: one at a time")
    notes: list[str] = []
    preset = gpu_preset or _preset_for(names[0])
    out: dict[str, Any] = {"model": cfgs[0].model, "dtype": cfgs[0].dtype}
    # the mixed fits' grid_blocks / mixed_keys columns (replay.analysis.steps.mixed_attention)
    # follow the longest chunk: the simulator must compute them alike
    out[MIXED_GRID_KEY] = "longest"
    tp = cfgs[0].tensor_parallel_size
    if tp > 1:  # the fits are rank 0's (its GPU pass holds the collectives): this degree only
        out[TP_KEY] = tp
        out[ALLREDUCE_KEY] = cfgs[0].tp_allreduce  # and its algorithm (sim.cost.model)
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
    p = save_profile(path, cal.profile)
    report = {"profile": str(p), "fit": cal.quality, "check": checks, "notes": cal.notes}
    if cal.verdict:
        report["verdict"] = cal.verdict
    if cal.shapes:
        report["shapes"] = cal.shapes
    if cal.spread:
        report["cpu_spread"] = cal.spread
    if cal.host_speed:
        report[HOST_KEY] = cal.host_speed
    text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    return atomic_file(p.with_name(p.stem + ".fit.json"), text)


def idle_from_sweeps(
    paths: Sequence[str | Path], model: str, from_runs: dict[str, float] | None, notes: list[str]
) -> dict[str, float] | None:
    """The runs' `gpu_pass.idle_start` table with the laws the idle-gap sweeps give in place
    of the runs' (a note each; the runs' laws stay in the fit report)."""
    try:
        keys, report = fit_idle_sweep(paths, model)
    except IdleGapFileError as e:
        raise CalibrationError(str(e)) from None
    for kind, r in report.items():
        if "shrink_per_ms" not in r:
            notes.append(f"idle-gap sweep, {kind} graphs: {r['note']}")
            continue
        notes.append(
            f"gpu_pass.idle_start ({kind} graphs, from the idle-gap sweep: {r['samples']} "
            f"samples over {r['shapes']} shapes): saves min({r['shrink_per_ms']:.2f} x (idle - "
            f"{r['shrink_after_ms']:.3f} ms), {r['shrink_max_fraction']:.2f} x pass); median "
            f"|error| {r['abs_err_ms_law']:.3f} ms (none: {r['abs_err_ms_none']:.3f} ms); it "
            "replaces the runs' law"
        )
    if not keys:
        return from_runs
    table = dict(from_runs) if from_runs is not None else {"scale": 1.0, "min_idle_ms": 0.05}
    table.update(keys)
    return table
