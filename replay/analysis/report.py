"""Human-facing output of replay: the fidelity report (fidelity.md + plots), the pass/fail table
printed by `compare`, and the short summary a measured run ends with.

Plots are PNG through matplotlib when it is installed, else SVG written by `bubblesim.core.svg`:
latency
CDFs, a predicted-vs-measured scatter of per-step GPU and CPU time, and both runs' timelines
over the same window of steps.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from bubblesim.core import svg
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import Run

TIMELINE_STEPS = 40  # steps shown in each timeline plot
TRACK_COLORS = {"cpu": 0, "gpu": 2, "bubble": 1, "sync": 4, "gc": 5}


# ---- printed tables --------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f} %"


def _val(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def target_rows(fid: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    rows = []
    for name, t in fid["targets"].items():
        m = fid["metrics"][name]
        if t["kind"] == "absolute_points":
            err = "-" if t["error"] is None else f"{t['error']:+.2f} pt"
            bound = f"<= {t['bound']:g} pt"
        else:
            err, bound = _pct(t["error"]), f"<= {100 * t['bound']:g} %"
        verdict = "PASS" if t["passed"] else "FAIL"
        rows.append((name, _val(m["predicted"]), _val(m["measured"]), err, bound, verdict))
    return rows


def print_targets(fid: dict[str, Any], out: Path | None = None) -> None:
    head = ("metric", "predicted", "measured", "error", "target", "")
    rows = [head, *target_rows(fid)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    st = fid["steps"]
    print(
        f"steps identical: {100 * st['fraction_identical']:.1f} % "
        f"({st['predicted_steps']} predicted, {st['measured_steps']} measured)"
    )
    for note in fid.get("notes", []):
        print(f"note: {note}")
    verdict = "PASS" if fid["passed"] else "FAIL"
    if fid.get("sides_warning"):
        verdict += " (not a fidelity check: see the warning)"
    print(f"fidelity: {verdict}" + (f"  -> {out}" if out else ""))


def print_run_summary(summary: dict[str, Any], out: Path, wall_s: float | None = None) -> None:
    src = summary.get("source", {})
    done = "" if summary.get("complete") else "  (INCOMPLETE)"
    wall = f"  ({wall_s:.2f} s wall)" if wall_s is not None else ""
    print(f"{src.get('kind', '?')} run on {src.get('gpu', '?')} -> {out}{wall}{done}")
    print(f"  requests/s       {summary.get('req_per_s') or 0:10.3f}")
    print(f"  output tok/s     {summary.get('output_tok_per_s') or 0:10.1f}")
    print(f"  GPU busy         {100 * (summary.get('gpu_busy_fraction') or 0):9.1f} %")
    print(f"  bubbles          {100 * (summary.get('bubble_fraction') or 0):9.1f} %")
    print("  latency (ms)          p50       p90       p99")
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        d = summary.get(key) or {}
        cells = " ".join(
            "-".rjust(9) if d.get(q) is None else f"{d[q] * 1e3:9.2f}"
            for q in ("p50", "p90", "p99")
        )
        print(f"    {key[:-2]:<14} {cells}")
    meas = summary.get("replay", {}).get("instrumentation") or {}
    if meas.get("overhead_fraction") is not None:
        print(f"  instrumentation  {100 * meas['overhead_fraction']:9.3f} % of step time")
    jit = summary.get("replay", {}).get("jit_compiles") or {}
    if jit.get("applicable"):
        took = f"{jit['seconds']:.2f} s"
        print(f"  Triton compiles  {jit['count']:9d}   in the measured run ({took})")


# ---- fidelity.md -----------------------------------------------------------------------------
def write_report(fid: dict[str, Any], pred: Run, meas: Run, out: Path) -> Path:
    """fidelity.md and its plots in `out` (already created)."""
    plots = _plots(pred, meas, out)
    lines = [
        "# Fidelity: predicted vs measured",
        "",
        f"- predicted: `{fid['predicted']['path']}` ({_source(fid['predicted'])})",
        f"- measured: `{fid['measured']['path']}` ({_source(fid['measured'])})",
        f"- verdict: **{'PASS' if fid['passed'] else 'FAIL'}** against the issue's targets",
    ]
    lines += [f"- note: {n}" for n in fid.get("notes", [])]
    if fid["config_differences"]:
        diffs = ", ".join(f"`{k}`" for k in fid["config_differences"])
        lines.append(f"- config keys that differ (other than hardware): {diffs}")
    lines += ["", "## Targets", "", "| metric | predicted | measured | error | target | |"]
    lines.append("|---|---|---|---|---|---|")
    lines += ["| " + " | ".join(r) + " |" for r in target_rows(fid)]
    lines += [
        "",
        "## All metrics",
        "",
        "Relative error = (predicted - measured) / measured; fractions in absolute points. "
        "`spread` is the measured run-to-run range over repeats (`replay run --repeat`).",
        "",
        "| metric | predicted | measured | error | spread |",
        "|---|---|---|---|---|",
    ]
    for name, m in fid["metrics"].items():
        lines.append(
            f"| {name} | {_val(m['predicted'])} | {_val(m['measured'])} | "
            f"{_err_cell(m)} | {_spread_cell(m)} |"
        )
    lines += _request_section(fid["requests"]) + _step_section(fid["steps"])
    lines += ["", "## Plots", ""]
    lines += [f"![{title}]({name})" for title, name in plots]
    path = out / "fidelity.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _source(d: dict[str, Any]) -> str:
    src = d.get("source") or {}
    kind = src.get("kind", "?")
    gpu = f" on {src['gpu']}" if src.get("gpu") else ""
    done = "" if d.get("complete") else ", INCOMPLETE"
    return f"{kind}{gpu}, {d.get('num_steps')} steps, {d.get('num_requests')} requests{done}"


def _err_cell(m: dict[str, Any]) -> str:
    if m["error_kind"] == "absolute_points":
        e = m.get("abs_error_points")
        return "-" if e is None else f"{e:+.2f} pt"
    return _pct(m["rel_error"])


def _spread_cell(m: dict[str, Any]) -> str:
    sp = m.get("measured_spread")
    if not sp:
        return ""
    if m["error_kind"] == "absolute_points":
        r = sp.get("range_points")
        cell = "-" if r is None else f"{r:.2f} pt"
    else:
        r = sp.get("range_rel")
        cell = "-" if r is None else f"{100 * r:.2f} %"
    return cell + (" (within)" if m.get("within_spread") else "")


def _request_section(req: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Per request (joined on request_id)",
        "",
        f"{req['matched']} matched, {req['only_predicted']} only predicted, "
        f"{req['only_measured']} only measured; output lengths equal: "
        f"{req['output_tokens_equal']}.",
        "",
        "| latency | n | rel. error p50 | p90 | p99 | mean abs. rel. error |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        r = req[key]
        e, a = r["rel_error"], r["abs_rel_error"]
        mean_abs = "-" if a["mean"] is None else f"{100 * a['mean']:.2f} %"
        lines.append(
            f"| {key} | {r['n']} | {_pct(e['p50'])} | {_pct(e['p90'])} | "
            f"{_pct(e['p99'])} | {mean_abs} |"
        )
    return lines


def _step_section(st: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Per step (matched by index)",
        "",
        f"{st['identical']} of {max(st['predicted_steps'], st['measured_steps'])} steps have "
        f"identical batch composition ({100 * st['fraction_identical']:.1f} %); "
        + (
            "no step differs."
            if st["first_difference"] is None
            else f"the first difference is at step {st['first_difference']}."
        ),
        "",
        "| time | n | predicted mean ms | measured mean ms | error ms p50 | abs. error ms p99 | "
        "rel. error p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [(f"GPU {k}", v) for k, v in st["gpu_ms_error"].items()]
    rows += [(f"CPU {k}", v) for k, v in st["cpu_ms_error"].items()]
    for label, e in rows:
        if not e["n"]:
            continue
        lines.append(
            f"| {label} | {e['n']} | {_val(e['predicted_ms_mean'])} | "
            f"{_val(e['measured_ms_mean'])} | {_val(e['error_ms']['p50'])} | "
            f"{_val(e['abs_error_ms']['p99'])} | {_pct(e['rel_error']['p50'])} |"
        )
    return lines


# ---- plots -----------------------------------------------------------------------------------
def _have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(values[np.isfinite(values)])
    return v, (np.arange(1, v.size + 1) / v.size if v.size else v)


def _plots(pred: Run, meas: Run, out: Path) -> list[tuple[str, str]]:
    """Write every plot into `out`; returns (title, file name) pairs."""
    mpl = _have_matplotlib()
    made = []
    p_req, m_req = pred.arrays("requests"), meas.arrays("requests")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end latency")):
        series = [
            (name, *_cdf(r[key] * 1e3)) for name, r in (("predicted", p_req), ("measured", m_req))
        ]
        title = f"{label} CDF"
        made.append((title, _save_lines(out, f"cdf_{key[:-2]}", series, title, "ms", mpl)))
    p, m = pred.arrays("steps"), meas.arrays("steps")
    n = min(len(p["step"]), len(m["step"]))
    gp = (p["gpu_end_s"] - p["gpu_start_s"])[:n] * 1e3
    gm = (m["gpu_end_s"] - m["gpu_start_s"])[:n] * 1e3
    title = "GPU time per step (matched by index)"
    made.append((title, _save_scatter(out, "step_gpu_ms", gp, gm, title, mpl)))
    cp, cm = _cpu_ms(p)[:n], _cpu_ms(m)[:n]
    title = "CPU time per step, all phases (matched by index)"
    made.append((title, _save_scatter(out, "step_cpu_ms", cp, cm, title, mpl)))
    first = max(0, n // 2 - TIMELINE_STEPS // 2)
    for name, run in (("predicted", p), ("measured", m)):
        last = min(first + TIMELINE_STEPS, len(run["step"])) - 1
        title = f"{name} timeline, steps {first}-{last}"
        made.append((title, _save_timeline(out, f"timeline_{name}", run, first, title, mpl)))
    return made


def _cpu_ms(s: dict[str, np.ndarray]) -> np.ndarray:
    total = np.zeros(len(s["step"]))
    for ph in CPU_PHASES:
        d = s[f"{ph}_end_s"] - s[f"{ph}_start_s"]
        total += np.where(np.isfinite(d), d, 0.0)
    return total * 1e3


def _timeline_tracks(s: dict[str, np.ndarray], first: int) -> tuple[list[Any], float, float]:
    """CPU phases / sync / GC / GPU / bubble boxes (ms) of steps first .. first + N - 1."""
    rows = slice(first, first + TIMELINE_STEPS)
    cpu = []
    for j, ph in enumerate(CPU_PHASES):
        for a, b in zip(s[f"{ph}_start_s"][rows], s[f"{ph}_end_s"][rows]):
            if np.isfinite(a):
                cpu.append((a * 1e3, b * 1e3, j))
    gpu = [
        (a * 1e3, b * 1e3, TRACK_COLORS["gpu"])
        for a, b in zip(s["gpu_start_s"][rows], s["gpu_end_s"][rows])
        if np.isfinite(a)
    ]
    sync = [
        (a * 1e3, b * 1e3, TRACK_COLORS["sync"])
        for a, b in zip(s["sync_start_s"][rows], s["sync_end_s"][rows])
        if np.isfinite(a)
    ]
    # steps.parquet keeps a bubble's length, not its pieces: drawn just before the GPU work
    bub = [
        ((g - b) * 1e3, g * 1e3, TRACK_COLORS["bubble"])
        for g, b in zip(s["gpu_start_s"][rows], s["bubble_before_s"][rows])
        if np.isfinite(g) and np.isfinite(b) and b > 0
    ]
    times = [t for box in cpu + gpu for t in box[:2]]
    t0, t1 = (min(times), max(times)) if times else (0.0, 1.0)
    tracks = [("CPU", cpu), ("sync", sync), ("GPU", gpu), ("bubble", bub)]
    return tracks, t0, t1


def _save_lines(out: Path, stem: str, series: list[Any], title: str, xlabel: str, mpl: bool) -> str:
    if mpl:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for label, xs, ys in series:
            ax.plot(xs, ys, label=label)
        ax.set(title=title, xlabel=xlabel, ylabel="fraction of requests")
        ax.legend()
        return _save_fig(fig, out, stem)
    (out / f"{stem}.svg").write_text(svg.line_file(series, title, xlabel, "fraction of requests"))
    return f"{stem}.svg"


def _save_scatter(
    out: Path, stem: str, pred: np.ndarray, meas: np.ndarray, title: str, mpl: bool
) -> str:
    if mpl:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(meas, pred, s=3, alpha=0.5)
        ok = np.isfinite(pred) & np.isfinite(meas)
        hi = float(max(pred[ok].max(), meas[ok].max())) if ok.any() else 1.0
        ax.plot([0, hi], [0, hi], "k--", lw=0.8)
        ax.set(title=title, xlabel="measured ms", ylabel="predicted ms")
        return _save_fig(fig, out, stem)
    (out / f"{stem}.svg").write_text(
        svg.scatter_file(meas, pred, title, "measured ms", "predicted ms")
    )
    return f"{stem}.svg"


def _save_timeline(
    out: Path, stem: str, s: dict[str, np.ndarray], first: int, title: str, mpl: bool
) -> str:
    tracks, t0, t1 = _timeline_tracks(s, first)
    legend = list(CPU_PHASES)
    if mpl:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(9, 3))
        colors = svg.FILE_COLORS
        for r, (_, boxes) in enumerate(tracks):
            ax.broken_barh(
                [(a, b - a) for a, b, _ in boxes],
                (len(tracks) - r - 1, 0.8),
                facecolors=[colors[c % len(colors)] for _, _, c in boxes],
            )
        ax.set_yticks([len(tracks) - r - 0.6 for r in range(len(tracks))])
        ax.set_yticklabels([label for label, _ in tracks])
        ax.set(title=title, xlabel="time since trace start (ms)", xlim=(t0, t1))
        return _save_fig(fig, out, stem)
    (out / f"{stem}.svg").write_text(svg.timeline_file(tracks, t0, t1, title, legend))
    return f"{stem}.svg"


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, which must be chosen before pyplot loads."""
    import matplotlib  # optional (mpl: installed), lazy: only a PNG report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    return plt


def _save_fig(fig: Any, out: Path, stem: str) -> str:
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=100)
    _pyplot().close(fig)
    return f"{stem}.png"
