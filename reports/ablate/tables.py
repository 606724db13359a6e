"""The ablation report's tables from `replay ablate --measured ... --calibrate-on off` outputs.

    python reports/ablate/tables.py reports/ablate/h100

One table per switch of each DIR/<seed>/ablate.json: each metric's median over the repeats of
each side (measured), the change (on - off) / off, the noise (two robust standard errors of
that difference, relative to off: a change inside it is not resolved), the predicted change,
and `replay ablate`'s verdict (replay.gpu.ablate.verdict: ok = same sign and within 25 % of the
measured size, else the size ratio or "sign differs"; "measured change within noise" where it
is not resolved). The bubble fraction is in percent, its change in points (and relative, as the
noise and the verdict take it): both sides count kernel-busy time
(replay.gpu.measure.kernel_busy) against the sim's passes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from replay.gpu.ablate import NOISE_SE, verdict  # NOISE_SE: a change within it is not resolved

UNITS = {  # metric -> (label, scale, format)
    "output_tok_per_s": ("output tok/s", 1.0, "{:.0f}"),
    "tpot_s.p50": ("TPOT p50 ms", 1e3, "{:.3f}"),
    "tpot_s.p99": ("TPOT p99 ms", 1e3, "{:.3f}"),
    "ttft_s.p50": ("TTFT p50 ms", 1e3, "{:.1f}"),
    "e2e_s.p50": ("e2e p50 s", 1.0, "{:.3f}"),
    "bubble_fraction": ("bubble %", 100.0, "{:.1f}"),
    "gpu_ms_mean": ("GPU ms/step", 1.0, "{:.3f}"),
}


def change(side: dict, metric: str) -> str:
    rel = f"{side['rel_change'][metric] * 100:+.1f} %"
    if metric == "bubble_fraction":
        return f"{(side['on'][metric] - side['off'][metric]) * 100:+.1f} pt ({rel})"
    return rel


def _repeats(m: dict) -> int:
    reps = m.get("repeats")
    return len(next(iter(reps["off"].values()))) if reps else 1


def table(switch: str, x: dict) -> str:
    m, p = x["measured"], x["predicted"]
    n = _repeats(m)
    rows = [
        f"`{switch}`: {x['values']['off']} -> {x['values']['on']}, "
        f"{n} repeat{'s' if n > 1 else ''} a side",
        "",
        "| metric | measured off | on | change | noise | predicted off | on | change | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for metric, (label, scale, fmt) in UNITS.items():
        noise = m.get("noise", {}).get(metric)
        noise_s = "-" if noise is None else f"±{NOISE_SE * noise * 100:.1f} %"
        rows.append(
            f"| {label} | {fmt.format(m['off'][metric] * scale)} | "
            f"{fmt.format(m['on'][metric] * scale)} | {change(m, metric)} | {noise_s} | "
            f"{fmt.format(p['off'][metric] * scale)} | {fmt.format(p['on'][metric] * scale)} | "
            f"{change(p, metric)} | {verdict(x['agreement'][metric])} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    args = ap.parse_args()
    for f in sorted(args.dir.glob("*/ablate.json")):
        for switch, x in json.loads(f.read_text()).items():
            if "predicted" in x:
                print(f"### {f.parent.name}\n\n{table(switch, x)}\n")


if __name__ == "__main__":
    main()
