"""The short human summary a run command ends with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bubblesim.core.cli_timeline import timeline_line
from sim.overload import overload_line


def _ms(d: dict[str, Any] | None, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v * 1e3:9.2f}"


def print_summary(summary: dict[str, Any], out: Path, wall_s: float | None = None) -> None:
    src = summary.get("source", {}).get("kind", "?")
    print(f"{src} run -> {out}" + (f"  ({wall_s:.2f} s wall)" if wall_s is not None else ""))
    print(f"  requests/s       {summary.get('req_per_s') or 0:10.3f}")
    print(f"  output tok/s     {summary.get('output_tok_per_s') or 0:10.1f}")
    print(f"  GPU busy         {100 * (summary.get('gpu_busy_fraction') or 0):9.1f} %")
    print(f"  bubbles          {100 * (summary.get('bubble_fraction') or 0):9.1f} %")
    causes = summary.get("bubble_s_by_cause") or {}
    for cause, sec in sorted(causes.items(), key=lambda kv: -kv[1])[:6]:
        if sec > 0:
            print(f"    {cause:<16} {sec:10.3f} s")
    print("  latency (ms)          p50       p90       p99")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = summary.get(key)
        print(f"    {key[:-2]:<14} {_ms(d, 'p50')} {_ms(d, 'p90')} {_ms(d, 'p99')}")
    for line in (overload_line(summary), timeline_line(summary.get("timeline") or {})):
        if line:
            print(f"  {line}")
