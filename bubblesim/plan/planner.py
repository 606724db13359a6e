"""`run_plan`: check everything, run every candidate's search on an executor, and assemble
plan.json: per candidate its load curve (one replica), highest sustained load, smallest fleet
per load and its cost; `best` = the cheapest candidate (cost per million output tokens) whose
fleet meets the SLOs at the trace's load (ties: fewer replicas, then candidate order).

Cost per million output tokens = replicas x GPUs per replica (tensor_parallel_size) x price
per GPU-hour / (output tokens per hour the fleet served) x 1e6, at the load the fleet was sized
for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bubblesim.core.atomic import atomic_file
from bubblesim.core.runfmt import trace_info
from bubblesim.core.trace import Trace, TraceError, read_trace, trace_sha256
from bubblesim.plan.fleet import check_trace_fits, kv_blocks
from bubblesim.plan.points import Point, PointStore, code_version, jsonable
from bubblesim.plan.search import CandidateSearch, search_all, verdict
from bubblesim.plan.spec import SLO, Candidate, PlanError, PlanSpec
from bubblesim.plan.sweep import Driver, Executor, SweepStats
from sim.cost import load_cost_model

FORMAT = "bubblesim-plan"
LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def preflight(spec: PlanSpec, trace_path: str | Path) -> Trace:
    """Every check that can fail on bad input, before any simulation: the trace against each
    model, each candidate's model on its GPU, the trace's longest request in its KV cache,
    its cost profile. Returns the trace (validated without a model)."""
    trace = read_trace(trace_path)
    checked: set[tuple[str, int]] = set()  # membership only
    for c in spec.candidates:
        cfg = c.config
        try:
            if (cfg.model, cfg.max_model_len) not in checked:
                from bubblesim.core.models import get_model, with_context

                read_trace(trace_path, with_context(get_model(cfg.model), cfg.max_model_len))
                checked.add((cfg.model, cfg.max_model_len))
            kv_blocks(cfg)
            check_trace_fits(cfg, trace, f"trace '{trace_path}'")
            load_cost_model(cfg)
        except (TraceError, ValueError) as e:
            raise PlanError(f"candidate '{c.name}': {e}") from None
    return trace


def _profile_sha(point: Point) -> str:
    prof = point.config.get("profile") or ""
    return trace_sha256(prof) if prof else ""


def run_plan(
    trace_path: str | Path,
    spec: PlanSpec,
    out_dir: str | Path,
    executor: Executor,
    resume: bool = True,
    progress: Callable[[SweepStats, int], None] | None = None,
) -> dict[str, Any]:
    """Plan, writing DIR/points.jsonl as points finish and DIR/plan.json at the end."""
    t0 = time.perf_counter()
    trace = preflight(spec, trace_path)
    info = trace_info(trace_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = PointStore(out / "points.jsonl", resume)
    searches, gens = search_all(spec.candidates, spec.search, spec.slos)
    driver = Driver(
        executor,
        store,
        str(trace_path),
        info["sha256"],
        spec.slos,
        spec.search.early_stop,
        _profile_sha,
        progress,
    )
    outcomes = driver.run(dict(gens))  # type: ignore[arg-type]
    plan = assemble(spec, trace, info, searches, outcomes)
    st = driver.stats
    plan["stats"] = {
        "points_run": st.run,
        "points_cached": st.cached,
        "points_repeated": st.repeated + st.shared,
        "points_same_run": st.same,
        "point_wall_s_sum": st.wall_s_sum,
        "point_cpu_s_sum": st.cpu_s_sum,
        "point_wall_s_max": max(st.wall_s, default=0.0),
        "wall_s": time.perf_counter() - t0,
    }
    write_json_atomic(out / "plan.json", plan)
    return plan


def write_json_atomic(path: Path, data: Any) -> None:
    atomic_file(path, json.dumps(jsonable(data), indent=1, allow_nan=False) + "\n")


# ---- assembling plan.json ---------------------------------------------------------------------
def trace_load(trace: Trace) -> dict[str, float]:
    span = float(trace.arrival_s.max() - trace.arrival_s.min()) if len(trace) > 1 else 0.0
    return {
        "rows": len(trace),
        "arrival_span_s": span,
        "req_per_s": len(trace) / span if span > 0 else 0.0,
        "offered_output_tok_per_s": float(np.sum(trace.output_len)) / span if span > 0 else 0.0,
    }


def brief(result: dict[str, Any], slos: tuple[SLO, ...]) -> dict[str, Any]:
    """What plan.json keeps of a point's result."""
    ok, bad = verdict(result, slos)
    keep = (
        "complete",
        "stopped",
        "num_requests",
        "num_finished",
        "span_s",
        "output_tok_per_s",
        "req_per_s",
        "gpu_s",
        "busy_s",
        "bubble_s",
        "idle_s",
        "bubble_fraction",
        "bubble_s_by_cause",
        "router",
        "wall_s",
        "key",
    )
    out: dict[str, Any] = {"ok": ok, "violated": bad}
    out.update({k: result.get(k) for k in keep})
    out.update({k: result.get(k) for k in LATENCY_KEYS})
    out["replicas"] = [
        {
            k: r[k]
            for k in (
                "requests",
                "busy_s",
                "bubble_s",
                "idle_s",
                "bubble_fraction",
                "bubble_s_by_cause",
            )
        }
        for r in result.get("replicas", [])
    ]
    return out


def cost_per_mtok(gpus: int, price_per_hour: float, tok_per_s: float | None) -> float | None:
    """USD per million output tokens of `gpus` GPUs at `price_per_hour` each."""
    if not tok_per_s:
        return None
    return gpus * price_per_hour / (tok_per_s * 3600.0) * 1e6


def _candidate_entry(
    c: Candidate, s: CandidateSearch, outcome: dict[str, Any], load: dict[str, float]
) -> dict[str, Any]:
    slos = s.slos
    curve = [{"factor": f, **brief(r, slos)} for f, r in sorted(s.probes.items())]
    fmax = outcome["max_load_factor"]
    at_max = s.probes.get(fmax) if fmax > 0 else None
    tok_max = at_max.get("output_tok_per_s") if at_max else None
    fleets = []
    tp = c.gpus_per_replica
    for f in outcome["fleets"]:
        n = f["replicas"]
        res = f["tried"].get(n) if n is not None else None
        fleets.append(
            {
                "load": f["load"],
                "replicas": n,
                "gpus": n * tp if n is not None else None,
                "feasible": n is not None,
                "reason": f.get("reason"),
                "cost_per_mtok": cost_per_mtok(
                    n * tp, c.price_per_hour, res.get("output_tok_per_s")
                )
                if res is not None and n is not None
                else None,
                "result": brief(res, slos) if res is not None else None,
                "tried": [
                    {"replicas": k, **dict(zip(("ok", "violated"), verdict(r, slos)))}
                    for k, r in sorted(f["tried"].items())
                ],
            }
        )
    main = next(f for f in fleets if f["load"] == 1.0)
    shown = main["result"] or next((p for p in curve if p["factor"] == 1.0), None)
    return {
        "index": c.index,
        "name": c.name,
        "overrides": c.overrides,
        "router": c.router,
        "gpu": c.config.gpu,
        "model": c.config.model,
        "price_per_hour": c.price_per_hour,
        "gpus_per_replica": tp,
        "config": c.config.to_dict(),
        "meets_slos": main["feasible"],
        "replicas": main["replicas"],
        "gpus": main["gpus"],
        "cost_per_mtok": main["cost_per_mtok"],
        "max_load_factor": fmax,
        "max_load_capped": outcome["max_load_capped"],
        "max_load_req_per_s": fmax * load["req_per_s"],
        "max_load_output_tok_per_s": tok_max,
        "cost_per_mtok_at_max_load": cost_per_mtok(tp, c.price_per_hour, tok_max),
        "gpu_time": {
            k: shown.get(k) if shown else None
            for k in ("gpu_s", "busy_s", "bubble_s", "idle_s", "bubble_s_by_cause")
        },
        "load_curve": curve,
        "fleets": fleets,
    }


def _pick(entries: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> Any:
    ok = [e for e in entries if e["meets_slos"] and e["cost_per_mtok"] is not None]
    if not ok:
        return None
    e = min(ok, key=key)
    return {
        **e["config"],
        "router": e["router"],
        "replicas": e["replicas"],
        "gpus_per_replica": e["gpus_per_replica"],
        "gpus": e["gpus"],
        "cost_per_mtok": e["cost_per_mtok"],
        "price_per_hour": e["price_per_hour"],
        "candidate": e["name"],
        "candidate_index": e["index"],
        "max_load_factor": e["max_load_factor"],
        # the load search stopped at its cap (search.max_load_factor) still passing: the
        # replica sustains at least max_load_factor, how much more is unknown
        "max_load_capped": e["max_load_capped"],
    }


def assemble(
    spec: PlanSpec,
    trace: Trace,
    info: dict[str, Any],
    searches: dict[int, CandidateSearch],
    outcomes: dict[Any, Any],
) -> dict[str, Any]:
    load = trace_load(trace)
    entries = [
        _candidate_entry(c, searches[c.index], outcomes[c.index], load) for c in spec.candidates
    ]
    return {
        "format": FORMAT,
        "format_version": 1,
        "code_version": code_version(),
        "trace": {**info, **load},
        "slos": {s.key: s.limit_s for s in spec.slos},
        "search": {k: getattr(spec.search, k) for k in spec.search.__dataclass_fields__},
        "best": _pick(entries, lambda e: (e["cost_per_mtok"], e["gpus"], e["index"])),
        "smallest_fleet": _pick(entries, lambda e: (e["gpus"], e["cost_per_mtok"], e["index"])),
        "candidates": entries,
    }
