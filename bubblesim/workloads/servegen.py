"""Reasoning workloads from Alibaba ServeGen's DeepSeek-R1 tables (Apache-2.0; Xiang et al.,
"ServeGen: Workload Characterization and Generation of LLM Serving in Production", 2025).

The data is per client ("chunk"), not per request:
- chunk-<i>-trace.csv: one row per 600 s window of the day: window_start_s, rate_rps, cv,
  pattern (Gamma | Weibull), two fitted parameters; rate 0 = the client is silent;
- chunk-<i>-dataset.json: per 6 h window ("0", "21600", ...), PMFs of input_tokens,
  output_tokens (reasoning included, up to ~29k) and reason_ratio, as Python-dict strings.

Generation: every client is an independent renewal process in each 600 s window, with the
window's rate (times `rate_scale`) and CV; Gamma windows draw Gamma gaps (shape 1/CV^2),
Weibull windows Weibull gaps of the same CV (the fitted parameters are not used, so the
table's rate and CV hold exactly in expectation). Each request's prompt and output lengths
are drawn independently from its client's PMFs of the 6 h window it arrives in. Client i
draws from numpy Generator([seed, i]), so clients don't perturb one another.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bubblesim.core.cli import UsageError
from bubblesim.core.trace import Trace, TraceError, make_trace
from bubblesim.workloads.arrivals import gaps

WINDOW_S = 600
PMF_WINDOW_S = 21_600
DAY_S = 86_400
SERVEGEN_LICENSE = (
    "Apache-2.0; ServeGen (github.com/alibaba/ServeGen), Xiang et al., 'ServeGen: Workload "
    "Characterization and Generation of LLM Serving in Production', arXiv 2505.09999"
)


@dataclass(frozen=True)
class Window:
    start_s: int
    rate: float
    cv: float
    pattern: str  # gamma | weibull


@dataclass(frozen=True)
class Client:
    index: int
    windows: tuple[Window, ...]  # active windows only (rate > 0)
    dataset: Path

    def pmf(self, window_s: int, field: str) -> tuple[np.ndarray, np.ndarray]:
        return _pmf(self.dataset, window_s, field)


_PMFS: dict[tuple[Path, int, str], tuple[np.ndarray, np.ndarray]] = {}
_JSON: dict[Path, dict] = {}


def _pmf(dataset: Path, window_s: int, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, probabilities) of one field's PMF in the 6 h window, nearest non-empty one."""
    key = (dataset, window_s, field)
    if key not in _PMFS:
        if dataset not in _JSON:
            _JSON[dataset] = json.loads(dataset.read_text())
        data = _JSON[dataset]
        order = sorted(data, key=lambda w: (abs(int(w) - window_s), int(w)))
        for w in order:
            text = str(data[w].get(field, "")).strip("{} \n")
            if text:
                pairs = np.array(re.split(r"[:,]", text), dtype=np.float64).reshape(-1, 2)
                _PMFS[key] = (pairs[:, 0], pairs[:, 1] / pairs[:, 1].sum())
                break
        else:
            raise TraceError(f"servegen dataset '{dataset}': no {field} distribution")
    return _PMFS[key]


def load_clients(folder: str | Path) -> list[Client]:
    """Every client with a trace CSV and a dataset JSON in `folder`, by chunk number."""
    d = Path(folder)
    if (d / "data/reason/deepseek-r1").is_dir():  # accept the ServeGen checkout root too
        d = d / "data/reason/deepseek-r1"
    csvs = sorted(d.glob("chunk-*-trace.csv"), key=lambda p: int(p.name.split("-")[1]))
    if not csvs:
        raise TraceError(f"servegen folder '{folder}': no chunk-<i>-trace.csv files")
    clients = []
    for path in csvs:
        index = int(path.name.split("-")[1])
        windows = []
        with open(path, newline="") as f:
            for line_no, row in enumerate(csv.reader(f), start=1):
                try:
                    start, rate, cv, pattern = int(float(row[0])), float(row[1]), row[2], row[3]
                    if rate > 0:
                        windows.append(Window(start, rate, float(cv), pattern.lower()))
                except (ValueError, IndexError):
                    raise TraceError(
                        f"servegen trace '{path}' line {line_no}: bad row {row}"
                    ) from None
        dataset = d / f"chunk-{index}-dataset.json"
        if windows and dataset.is_file():
            clients.append(Client(index, tuple(windows), dataset))
    return clients


def _renewal(rng: np.random.Generator, w: Window, rate: float, t0: float, t1: float) -> np.ndarray:
    """Arrivals in [t0, t1) of a renewal process started at the window's start."""
    out, t = [], float(w.start_s)
    batch = max(16, int(rate * WINDOW_S * 1.2))
    while t < t1:
        more = t + np.cumsum(gaps(rng, w.pattern, rate, w.cv, batch))
        out.append(more)
        t = float(more[-1])
    times = np.concatenate(out) if out else np.zeros(0)
    return times[(times >= t0) & (times < t1)]


def servegen_trace(
    folder: str | Path,
    seed: int,
    start_s: float,
    duration_s: float,
    rate_scale: float = 1.0,
    max_output: int = 32_768,
    needs_history: float = 1.0,
) -> Trace:
    if not (start_s >= 0 and duration_s > 0 and start_s + duration_s <= DAY_S):
        raise UsageError(f"--start-s/--duration-s: the span must lie within one day ({DAY_S} s)")
    if not rate_scale > 0:
        raise UsageError(f"--rate-scale {rate_scale}: must be > 0")
    t1 = start_s + duration_s
    times: list[np.ndarray] = []
    prompts: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    for c in load_clients(folder):
        rng = np.random.default_rng([seed, c.index])
        for w in c.windows:
            if w.start_s + WINDOW_S <= start_s or w.start_s >= t1:
                continue
            t = _renewal(
                rng, w, w.rate * rate_scale, max(start_s, w.start_s), min(t1, w.start_s + WINDOW_S)
            )
            pmf_w = int(w.start_s // PMF_WINDOW_S * PMF_WINDOW_S)
            for field, sink in (("input_tokens", prompts), ("output_tokens", outputs)):
                values, probs = c.pmf(pmf_w, field)
                sink.append(values[rng.choice(len(values), size=len(t), p=probs)])
            times.append(t)
    if not times or not sum(len(t) for t in times):
        raise UsageError(f"servegen: no requests in [{start_s:g}, {t1:g}) s at this rate scale")
    arrival = np.concatenate(times) - start_s
    order = np.argsort(arrival, kind="stable")
    prompt = np.clip(np.concatenate(prompts)[order], 1, None)
    output = np.clip(np.concatenate(outputs)[order], 1, max_output)
    n = len(order)
    hist = np.random.default_rng([seed, 1 << 20]).random(n) < needs_history
    return make_trace(
        arrival[order],
        prompt,
        output,
        needs_history=hist,
        metadata={
            "source": "ServeGen DeepSeek-R1 client tables (data/reason/deepseek-r1), generated",
            "license": SERVEGEN_LICENSE,
            "description": f"{n} requests over [{start_s:g}, {t1:g}) s of the day, per-client "
            f"Gamma/Weibull arrivals at {rate_scale:g} x the recorded rates, lengths from the "
            f"clients' 6 h PMFs, outputs capped at {max_output}; seed {seed}",
        },
    )
