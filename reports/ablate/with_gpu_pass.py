"""A base profile for `reports/ablate/predict.sh`: the engine's seed-part terms
(`bench/spec_parts.py --profile`) with the GPU pass of a committed profile of the same model and
GPU (its `gpu_pass`: decode and verify tables, mixed pass, idle-start law).

    python reports/ablate/with_gpu_pass.py TERMS PROFILE -o OUT

Why: a seed's before side is often paced by the host (seed 5: the accepted-count wait), so its
steps hold too few kernel-only intervals for `replay ablate --calibrate-on off` to fit the GPU
pass, and the fit keeps the base profile's pass (else the roofline). The profile's pass was
fitted on other runs and sweeps of the same engine and GPU, never on the ablation's runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("terms", type=Path, help="engine terms (bench/spec_parts.py --profile)")
    ap.add_argument("profile", type=Path, help="a calibrated profile: its gpu_pass is taken")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    terms, prof = json.loads(args.terms.read_text()), json.loads(args.profile.read_text())
    out = {
        "version": terms.get("version", 1),
        "notes": (
            f"{args.terms.name} (this engine's cost of each seed's after-side parts) + the GPU "
            f"pass of {args.profile} ({prof.get('model')}, {prof.get('gpu')}, fitted on its own "
            "calibration runs and sweeps), by reports/ablate/with_gpu_pass.py"
        ),
        "model": prof.get("model"),
        "gpu": prof.get("gpu"),
        "terms": terms["terms"],
        "gpu_pass": prof["gpu_pass"],
    }
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"base profile -> {args.output}")


if __name__ == "__main__":
    main()
