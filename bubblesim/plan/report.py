"""report.html of a plan: one self-contained file (inline CSS, SVG and a few lines of JS; no
network). Plots: latency vs load with the SLO lines, where each config's GPU time goes, fleet
size vs load, cost per million output tokens; then a table of every candidate.

The script at the end counts, per chart, the marks the browser laid out (non-empty bounding
boxes) and sets data-drawn on the <svg>, and data-plots-drawn / data-plots-total on <body>:
tests/test_plan_report.py reads them from headless Chromium's DOM.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any

from bubblesim.core.atomic import atomic_file
from bubblesim.core.runfmt import CAUSES
from bubblesim.core.svg import Chart, Series, bar_chart, color, line_chart, stacked_bars
from bubblesim.plan.merge import UNATTRIBUTED

MAX_LINES = 8  # candidates drawn in the line charts
MAX_BARS = 14
_SHORT = {
    "batches_in_flight": "bif",
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "tokens",
    "spec.method": "spec",
    "tensor_parallel_size": "tp",
    "spec.k": "k",
    "optimistic_spec_decode": "optimistic",
    "kv_memory_fraction": "kv",
}
_CAUSE_COLORS = {
    "busy": "#4e79a7",
    **{
        c: col
        for c, col in zip(
            CAUSES,
            (
                "#e15759",
                "#f28e2b",
                "#edc948",
                "#b07aa1",
                "#ff9da7",
                "#9c755f",
                "#76b7b2",
                "#59a14f",
                "#d37295",
            ),
        )
    },
    "bubbles (not attributed)": "#bbbbbb",
    "idle (no request)": "#e4e4e4",
}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;
max-width:1340px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd;
padding-bottom:4px}p.note{color:#555;margin:4px 0 10px;max-width:1000px}
.answer{background:#f3f8f1;border:1px solid #b9d8ad;border-radius:6px;padding:10px 14px;
margin:12px 0}.answer.none{background:#fbf0ef;border-color:#e2b3ae}
.answer b{font-size:16px}.grid2{display:flex;flex-wrap:wrap;gap:18px}
figure.chart{margin:0;border:1px solid #e4e4e4;border-radius:6px;padding:6px 8px;background:#fff}
svg .title{font-size:14px;font-weight:600}svg .tick{font-size:11px;fill:#555}
svg .label{font-size:12px;fill:#333}svg .grid{stroke:#eee}svg .plotbg{fill:#fcfcfc;stroke:#ccc}
svg .series{fill:none;stroke-width:2}svg .slo{stroke:#d62728;stroke-width:1.5;stroke-dasharray:7 4}
svg .slotext{font-size:11px;fill:#d62728;font-weight:600}svg .vref{stroke:#888;stroke-dasharray:2 3}
svg .vtext{font-size:11px;fill:#666}
.legend{font-size:12px;color:#333;max-width:640px;margin-top:4px}
.legend span{display:inline-block;margin:0 12px 2px 0}.legend i{display:inline-block;width:11px;
height:11px;border-radius:2px;margin-right:4px;vertical-align:-1px}
table{border-collapse:collapse;font-size:12.5px;margin-top:6px}
th,td{border-bottom:1px solid #e6e6e6;padding:3px 8px;text-align:right;white-space:nowrap}
th{background:#f6f6f6;position:sticky;top:0}td.l,th.l{text-align:left}
tr.best td{background:#eef7ea;font-weight:600}tr.fail td{color:#999}
code{background:#f4f4f4;padding:0 3px;border-radius:3px}
"""

CHECK_JS = """
(function(){var plots=document.querySelectorAll('svg[data-plot]'),ok=0;
plots.forEach(function(svg){var n=0;svg.querySelectorAll('.mark').forEach(function(m){
var b=m.getBBox();if(b.width>0&&b.height>0)n++;});svg.setAttribute('data-drawn',String(n));
var r=svg.getBoundingClientRect();if(n>0&&n===Number(svg.dataset.marks)&&r.width>0)ok++;});
document.body.setAttribute('data-plots-drawn',String(ok));
document.body.setAttribute('data-plots-total',String(plots.length));})();
"""


def _gpus(c: dict[str, Any]) -> str:
    """The fleet's GPUs, 'replicas x GPUs per replica' under tensor parallelism."""
    tp = c.get("gpus_per_replica", 1)
    if c["replicas"] is None:
        return f"- ({tp}/replica)" if tp > 1 else "-"
    gpus = c.get("gpus", c["replicas"] * tp)  # plan.json written before tensor parallelism
    return f"{gpus} ({c['replicas']} x {tp})" if tp > 1 else str(gpus)


def short_name(c: dict[str, Any]) -> str:
    parts = [f"{_SHORT.get(k, k)}={v}" for k, v in c["overrides"].items()]
    return f"#{c['index']} " + (" ".join(parts) if parts else "base")


def _ranked(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Candidates best first: meeting the SLOs by cost, then the rest by sustained load."""
    return sorted(
        plan["candidates"],
        key=lambda c: (
            not c["meets_slos"],
            c["cost_per_mtok"] or math.inf,
            -c["max_load_factor"],
            c["index"],
        ),
    )


def _fmt(x: Any, spec: str, dash: str = "–") -> str:
    return dash if x is None else format(x, spec)


# ---- the plots ---------------------------------------------------------------------------------
def latency_charts(plan: dict[str, Any], shown: list[dict[str, Any]]) -> list[str]:
    rate = plan["trace"]["req_per_s"] or 1.0
    out = []
    for key, limit in plan["slos"].items():
        metric, q = key.rsplit("_", 2)[0], key.rsplit("_", 2)[1]
        series = []
        for i, c in enumerate(shown):
            pts = []
            for p in c["load_curve"]:
                v = (p.get(f"{metric}_s") or {}).get(q)
                x = p["factor"] * rate
                where = f"{short_name(c)}: {p['factor']:g}x load ({x:.2f} req/s) {key[:-2]}"
                if p["complete"] and v is not None:
                    pts.append((x, v, True, f"{where} {v * 1e3:.1f} ms"))
                elif not p["complete"] and (p.get("stopped") or {}).get("slo") == key:
                    # stopped once this SLO was surely missed: the final value is above it
                    shown_v = max(v or 0.0, limit)
                    pts.append((x, shown_v, False, f"{where} > {limit * 1e3:.1f} ms (stopped)"))
            series.append(Series(short_name(c), pts, color(i)))
        ch = Chart(
            f"latency-{key}",
            f"{metric.upper()} {q} vs load (one replica)",
            "offered load (requests/s)",
            f"{metric} {q} (s)",
        )
        out.append(
            line_chart(
                ch,
                series,
                xlog=True,
                ylog=True,
                hlines=[(limit, f"SLO {limit:g} s")],
                vlines=[(rate, "trace load")],
                extra_legend="<span>○ = run stopped once this SLO was surely "
                "missed (drawn at max(value so far, SLO))</span>",
            )
        )
    return out


def gpu_time_chart(shown: list[dict[str, Any]]) -> str:
    rows = []
    used: dict[str, str] = {}
    for c in shown:
        g = c["gpu_time"]
        total = g.get("gpu_s") or 0.0
        if total <= 0:
            continue
        segs = [("busy", 100 * g["busy_s"] / total)]
        by_cause = g.get("bubble_s_by_cause")
        if by_cause is None and (g.get("bubble_s") or 0) > 0:
            by_cause = {"bubbles (not attributed)": g["bubble_s"]}
        for cause, s in sorted((by_cause or {}).items(), key=lambda kv: -kv[1]):
            if s > 0:
                name = "bubbles (not attributed)" if cause == UNATTRIBUTED else cause
                segs.append((name, 100 * s / total))
        segs.append(("idle (no request)", 100 * max(g["idle_s"], 0.0) / total))
        for name, _ in segs:
            used[name] = _CAUSE_COLORS.get(name, "#999")
        n = f" x{c['replicas']}" if c["replicas"] else " x1 (fails)"
        rows.append((short_name(c)[:38] + n, segs))
    order = ["busy", *CAUSES, "bubbles (not attributed)", "idle (no request)"]
    colors = {k: used[k] for k in order if k in used}
    height = max(150, 46 + 80 + 30 * len(rows))
    ch = Chart(
        "gpu-time",
        "Where GPU time goes at the trace's load (% of fleet GPU time)",
        "% of GPU time (busy, bubbles by cause, idle)",
        "",
        width=1000,
        height=height,
        margin=(34, 24, 46, 330),
    )
    return stacked_bars(ch, rows, colors)


def fleet_chart(plan: dict[str, Any], shown: list[dict[str, Any]]) -> str:
    rate = plan["trace"]["req_per_s"] or 1.0
    loads = [f["load"] for f in shown[0]["fleets"]] if shown else [1.0]
    span = [min(loads) / 2, max(loads) * 2]
    grid = [span[0] * (span[1] / span[0]) ** (k / 40) for k in range(41)]
    series = []
    for i, c in enumerate(shown):
        pts = [
            (
                f["load"] * rate,
                float(f["replicas"]),
                True,
                f"{short_name(c)}: {f['replicas']} replica(s) at {f['load']:g}x load",
            )
            for f in c["fleets"]
            if f["replicas"] is not None
        ]
        series.append(Series(short_name(c), pts, color(i)))
        fmax = c["max_load_factor"]
        if fmax > 0:
            est = [(x * rate, float(math.ceil(x / fmax - 1e-9)), True, "") for x in grid]
            series.append(Series("", est, color(i), dashed=True, markers=False))
    ch = Chart("fleet-size", "Fleet size vs load", "offered load (requests/s)", "replicas")
    return line_chart(
        ch,
        series,
        xlog=True,
        vlines=[(rate, "trace load")],
        extra_legend="<span>● simulated smallest fleet; dashed: "
        "ceil(load / highest load one replica sustains)</span>",
    )


def cost_chart(shown: list[dict[str, Any]]) -> str | None:
    rows = []
    for c in shown:
        if c["cost_per_mtok"] is None:
            continue
        bars = [
            (
                c["cost_per_mtok"],
                "#4e79a7",
                f"{short_name(c)}: ${c['cost_per_mtok']:.3f}/Mtok with {c['replicas']} "
                "replica(s) at the trace's load",
            )
        ]
        if c["cost_per_mtok_at_max_load"]:
            bars.append(
                (
                    c["cost_per_mtok_at_max_load"],
                    "#a0cbe8",
                    f"{short_name(c)}: ${c['cost_per_mtok_at_max_load']:.3f}/Mtok for one "
                    f"replica at its highest sustained load ({sustains(c)})",
                )
            )
        rows.append((short_name(c)[:38], bars))
    if not rows:
        return None
    height = max(150, 46 + 60 + 34 * len(rows))
    ch = Chart(
        "cost",
        "Cost per million output tokens (USD)",
        "USD per million output tokens",
        "",
        width=1000,
        height=height,
        margin=(34, 24, 46, 330),
    )
    names = [
        ("fleet at the trace's load", "#4e79a7"),
        ("one replica at its highest sustained load", "#a0cbe8"),
    ]
    return bar_chart(ch, rows, names)


# ---- the page ----------------------------------------------------------------------------------
def sustains(c: dict[str, Any]) -> str:
    """'64x', or 'at least 64x' when the load search stopped at its cap still passing."""
    return ("at least " if c.get("max_load_capped") else "") + f"{c['max_load_factor']:g}x"


def _answer(plan: dict[str, Any]) -> str:
    best = plan["best"]
    if best is None:
        return (
            '<div class="answer none"><b>No candidate meets the SLOs at the trace\'s '
            "load</b> (within max_replicas). The load curves below show how close each "
            "came.</div>"
        )
    sm = plan["smallest_fleet"]
    spec = best.get("spec") or {}
    extra = ""
    if sm and sm["candidate_index"] != best["candidate_index"]:
        extra = (
            f"<br>Smallest fleet: <code>{escape(sm['candidate'])}</code> with "
            f"{sm['replicas']} replica(s), ${sm['cost_per_mtok']:.3f}/Mtok."
        )
    gpu = escape(str(best["gpu"]).upper())
    tp = best.get("gpus_per_replica", 1)
    fleet = f"{best['replicas']} x {gpu}"
    if tp > 1:  # tensor parallel: GPUs per replica, and the fleet's GPUs
        fleet = f"{best['replicas']} replica(s) of {tp} x {gpu} ({best['gpus']} GPUs)"
    return (
        f'<div class="answer"><b>Best: {fleet} '
        f"running {escape(str(best['model']))}, ${best['cost_per_mtok']:.3f} per million output "
        f"tokens</b><br>candidate <code>{escape(best['candidate'])}</code>: "
        f"batches_in_flight={best['batches_in_flight']}, max_num_seqs={best['max_num_seqs']}, "
        f"max_num_batched_tokens={best['max_num_batched_tokens']}, "
        f"spec={escape(str(spec.get('method')))}, router={escape(best['router'])}; one replica "
        f"sustains {sustains(best)} the trace's load.{extra}</div>"
    )


def _table(plan: dict[str, Any], ranked: list[dict[str, Any]]) -> str:
    slo_keys = list(plan["slos"])
    head = (
        "<tr><th class=l>candidate</th><th>meets</th><th>replicas</th><th>GPUs</th>"
        "<th>$/Mtok</th>"
        "<th>max load</th><th>req/s</th>"
        + "".join(f"<th>{escape(k[:-2])} (ms)</th>" for k in slo_keys)
        + "<th>bubbles</th><th>points</th></tr>"
    )
    best = plan["best"]
    rows = []
    for c in ranked:
        f1 = next(f for f in c["fleets"] if f["load"] == 1.0)
        res = f1["result"] or next((p for p in c["load_curve"] if p["factor"] == 1.0), None) or {}
        cls = (
            "best"
            if best and best["candidate_index"] == c["index"]
            else ("" if c["meets_slos"] else "fail")
        )
        lat = []
        for k in slo_keys:
            metric, q = k.rsplit("_", 2)[0], k.rsplit("_", 2)[1]
            v = (res.get(f"{metric}_s") or {}).get(q)
            lat.append(f"<td>{_fmt(v * 1e3 if v is not None else None, '.1f')}</td>")
        cap = ">=" if c["max_load_capped"] else ""
        rows.append(
            f'<tr class="{cls}"><td class=l>{escape(short_name(c))}</td>'
            f"<td>{'yes' if c['meets_slos'] else 'no'}</td><td>{_fmt(c['replicas'], 'd')}</td>"
            f"<td>{_gpus(c)}</td>"
            f"<td>{_fmt(c['cost_per_mtok'], '.3f')}</td>"
            f"<td>{cap}{c['max_load_factor']:.3g}x</td><td>{c['max_load_req_per_s']:.2f}</td>"
            + "".join(lat)
            + f"<td>{_fmt(100 * res['bubble_fraction'] if res.get('bubble_fraction') is not None else None, '.2f')} %</td>"  # noqa: E501
            f"<td>{len(c['load_curve']) + sum(len(f['tried']) for f in c['fleets'])}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _capped_note(plan: dict[str, Any], ranked: list[dict[str, Any]]) -> str:
    if not any(c["max_load_capped"] for c in ranked):
        return ""
    cap = plan["search"]["max_load_factor"]
    return (
        f'<p class="note">&gt;= in "max load": at least that. The load search stopped at its '
        f"cap ({cap:g}x the trace's load) still meeting the SLOs, so the highest load one "
        "replica sustains is unknown beyond it (raise max_load_factor in the candidates "
        "file's [search] table, or plan on a longer or denser trace).</p>"
    )


def render(plan: dict[str, Any]) -> str:
    ranked = _ranked(plan)
    shown = ranked[:MAX_LINES]
    tr = plan["trace"]
    slos = ", ".join(f"<code>{escape(k)} &le; {v:g}</code>" for k, v in plan["slos"].items())
    st = plan.get("stats", {})
    prices = ", ".join(sorted({f"{c['gpu']} {c['price_per_hour']:g}" for c in ranked}))
    charts_lat = latency_charts(plan, shown)
    cost = cost_chart(ranked[:MAX_BARS])
    more = (
        f" Showing the best {len(shown)} of {len(ranked)} candidates; all are in the table."
        if len(ranked) > len(shown)
        else ""
    )
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f"<title>Capacity plan: {escape(Path(tr['path']).name)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>Capacity plan for <code>{escape(Path(tr['path']).name)}</code></h1>",
        f'<p class="note">{tr["rows"]:,} requests over {tr["arrival_span_s"]:.0f} s '
        f"({tr['req_per_s']:.2f} req/s, {tr['offered_output_tok_per_s']:.0f} output tok/s "
        f"offered); SLOs {slos}; {len(plan['candidates'])} candidates.</p>",
        _answer(plan),
        '<h2 id="latency">Latency vs load, one replica</h2>',
        '<p class="note">Each candidate\'s arrival rate scaled (arrival_s / factor) to find the '
        f"highest load it sustains within the SLOs (red dashed lines).{more}</p>",
        f'<div class="grid2">{"".join(charts_lat)}</div>',
        '<h2 id="fleet">Fleet size vs load</h2>',
        f'<div class="grid2">{fleet_chart(plan, shown)}</div>',
        '<h2 id="gpu-time">Where GPU time goes</h2>',
        '<p class="note">For the smallest fleet meeting the SLOs at the trace\'s load (one '
        "replica where none does): GPU busy, bubbles (GPU idle while requests wait) by the CPU "
        "activity the GPU waited for, and idle time with no request in the engine.</p>",
        gpu_time_chart(ranked[:MAX_BARS]),
        '<h2 id="cost">Cost</h2>',
        cost or '<p class="note">No candidate meets the SLOs: no cost to show.</p>',
        '<h2 id="candidates">All candidates</h2>',
        _table(plan, ranked),
        _capped_note(plan, ranked),
        f'<p class="note">{st.get("points_run", 0)} points simulated, '
        f"{st.get('points_cached', 0)} reused from an earlier run, {st.get('wall_s', 0):.1f} s. "
        f"Code version {escape(plan.get('code_version', ''))}; prices are USD per GPU-hour "
        f"({escape(prices)}); a replica of tensor_parallel_size N costs N GPUs.</p>",
        f"<script>{CHECK_JS}</script></body></html>",
    ]
    return "".join(parts)


def write_report(plan: dict[str, Any], path: str | Path) -> Path:
    return atomic_file(path, render(plan))
