"""What a shape sweep file's samples measure (parquet metadata `replay.shapes`, key MEASURES_KEY).

Shared by `replay shapes` (which writes it) and `replay calibrate` (which reads it):
- MEASURES_STEP ("step"): a sample times what a run step's GPU interval holds (input copy, the
  same CUDA graph or eager forward, sampling), so sweep rows and clean run steps are the same
  quantity and no offset between them is estimated;
- absent (files written before the key): forward + logits only; a run's interval holds more
  (input copy, finishing kernels, sampling), so calibration shifts the sweep by the offset the
  runs' clean steps show (replay.analysis.calibrate, replay.analysis.piecewise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MEASURES_KEY = "measures"
MEASURES_STEP = "step"


def measures_steps(meta: Mapping[str, Any]) -> bool:
    """Whether a sweep file's samples time a whole run step (MEASURES_STEP)."""
    return meta.get(MEASURES_KEY) == MEASURES_STEP
