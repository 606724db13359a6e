"""Each sampling mode timed against greedy sampling, per sampled row (`python -m replay sampling`).

Every shape sweep and calibration run samples greedily (the default config), so a profile's GPU
tables and CPU phases hold greedy sampling; this sweep measures what each random mode
(sim.cost.sampling.MODES) adds, on the engine's own `Sampler` at the model's vocabulary, for G
sampled rows (ROWS up to --max-rows):

- `sample` GPU: one `Sampler.sample_graph` of G rows (plain decoding's sampler, as a decode or
  mixed CUDA graph holds it), captured in a CUDA graph and replayed back to back: ms a replay;
- `sample` host: one eager `Sampler.sample` of G rows (a step whose sampling is in no graph:
  the sample phase), host ms of the call, the GPU drained before each call and, for `host_ms`,
  EngineLikeWork run before it (`host_hot_ms`: back to back, reported, not fitted);
- `choose` GPU and host: the same of `Sampler.choose` (speculative decoding verifies its k + 1
  rows per request there, eagerly, after the graph).

The logits are float32 normals; the rows carry forced tokens, as a replay's do (the engine
forces the trace's outputs, which changes no kernel). Penalties are left out: they cost the same
in every mode (gpu_pass.history). Each sample is the median of `repeats` timings. On CPU (tests)
there is no graph: the GPU numbers are the eager call's wall time (the plumbing, not the law).

The file (replay.analysis.sampling_file) holds one row per (mode, path, rows); `replay calibrate
--sampling-sweep FILE` writes the profile's `sampling` table (sim.cost.sampling) from it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bubblesim.core.config import Config
from bubblesim.core.models import get_model, with_context
from engine.sampler import Sampler, SampleRows
from replay.analysis.sampling_file import write_sampling
from replay.gpu.run import as_run, gpu_name, versions
from replay.gpu.shapes import engine_commit
from sim.cost.sampling import GREEDY, MODES

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024)
REPLAYS = 10  # graph replays per GPU timing (their mean)


@dataclass
class SamplingResult:
    path: Path
    rows: list[dict[str, Any]]
    wall_s: float
    meta: dict[str, Any]


def _sample_rows(g: int, vocab: int, device: torch.device) -> SampleRows:
    """G rows in slots 0 .. G - 1, each with a forced token (as a replay's rows)."""
    r = torch.arange(g, dtype=torch.int32, device=device)
    forced = (r * 7919) % vocab  # any valid token id
    none = torch.empty(0, dtype=torch.int32, device=device)
    return SampleRows(r, r * 0, r, None, none, forced_tok=forced)


class _Case:
    """One mode's sampler at G rows, its inputs and outputs preallocated."""

    def __init__(self, cfg: Config, mode: str, g: int, vocab: int, device: torch.device) -> None:
        params = {"temperature": 0.0} if mode == GREEDY else MODES[mode]
        sampling = dataclasses.replace(cfg.sampling, **params)
        self.sampler = Sampler(sampling, cfg.seed, g, vocab, device)
        gen = torch.Generator(device=device).manual_seed(cfg.seed + g)
        self.logits = torch.randn(g, vocab, generator=gen, device=device, dtype=torch.float32)
        self.rows = _sample_rows(g, vocab, device)
        self.hist = torch.zeros(g, dtype=torch.int32, device=device)
        self.out = torch.empty(g, dtype=torch.int32, device=device)

    def sample_graph(self) -> None:
        self.sampler.sample_graph(self.logits, self.rows, self.hist, self.out, False)

    def sample(self) -> None:
        self.sampler.sample(self.logits, self.rows, self.out)

    def choose(self) -> None:
        self.out.copy_(self.sampler.choose(self.logits, self.rows))


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class EngineLikeWork:
    """Host work standing in for what a run does between two eager samplings: an eager
    forward's worth of small launches over other tensors and a walk over a few MB of other
    Python objects. A hot loop of the same call reads less than a run does (the dispatcher's
    and the CPU's caches stay warm; H200 and H100, 2026-11-27: a run's eager top_p sampling
    cost 1.24-1.56x what a hot loop measured), so `host_ms` runs this before each call and
    `host_hot_ms` does not."""

    def __init__(self, device: torch.device, launches: int = 250) -> None:
        self.x = [torch.randn(64, 64, device=device) for _ in range(8)]
        self.rounds = max(1, launches // 5)
        self.junk = list(range(1 << 20))
        self.last = 0  # the walk's sum, kept so the walk is the point of the loop

    def __call__(self) -> None:
        x = self.x
        for i in range(self.rounds):  # five launches a round
            a = x[i % len(x)]
            b = torch.add(a, 1.0)
            c = torch.relu(b * a)
            torch.cat([c.sum(dim=0), b[0]])
        total = 0
        for v in self.junk[::8]:
            total += v
        self.last = total


def host_ms(
    fn: Callable[[], None], repeats: int, cuda: bool, before: Callable[[], None] | None = None
) -> float:
    """Median host time of one call, the GPU drained before each (a call never waits on a full
    launch queue); `before` runs ahead of each (untimed)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        _sync(cuda)
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    _sync(cuda)
    return statistics.median(times)


def graph_ms(fn: Callable[[], None], repeats: int, cuda: bool) -> float:
    """Median GPU ms of `fn` captured in a CUDA graph (the mean of REPLAYS replays back to back,
    `repeats` times); on CPU the eager call's wall time."""
    if not cuda:
        return host_ms(fn, repeats, cuda)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPLAYS)
    del graph
    return statistics.median(times)


def sweep_sampling(
    cfg: Config,
    out: str | Path,
    max_rows: int = ROWS[-1],
    repeats: int = 15,
    progress: Callable[[str], None] | None = None,
) -> SamplingResult:
    """Time greedy and every mode of MODES at ROWS up to `max_rows`; write the file `out`
    (module docstring)."""
    if repeats < 1 or max_rows < 1:
        raise ValueError("repeats and max_rows must be >= 1")
    t0 = time.monotonic()
    model = with_context(get_model(cfg.model), cfg.max_model_len)
    vocab = model.vocab_size
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("device 'cuda' but no GPU is visible: set device=cpu")
    grid: Sequence[int] = [g for g in ROWS if g <= max_rows] or [max_rows]
    rows: list[dict[str, Any]] = []
    work = EngineLikeWork(device)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection inside a host timing would blur it
    try:
        with torch.no_grad():
            for g in grid:
                for mode in (GREEDY, *MODES):
                    if progress is not None:
                        progress(f"{g} rows: {mode}")
                    case = _Case(cfg, mode, g, vocab, device)
                    timed = {
                        ("sample", "gpu_ms"): graph_ms(case.sample_graph, repeats, cuda),
                        ("sample", "host_ms"): host_ms(case.sample, repeats, cuda, work),
                        ("sample", "host_hot_ms"): host_ms(case.sample, repeats, cuda),
                        ("choose", "gpu_ms"): graph_ms(case.choose, repeats, cuda),
                        ("choose", "host_ms"): host_ms(case.choose, repeats, cuda, work),
                        ("choose", "host_hot_ms"): host_ms(case.choose, repeats, cuda),
                    }
                    for (path, what), ms in timed.items():
                        rows.append({"mode": mode, "path": path, "what": what, "rows": g, "ms": ms})
                    del case
                    if cuda:
                        torch.cuda.empty_cache()
    finally:
        if was_enabled:
            gc.enable()
    commit, dirty = engine_commit()
    meta = {
        "model": model.name,
        "vocab": vocab,
        "gpu": gpu_name(as_run(cfg)),
        "device": cfg.device,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "repeats": repeats,
        "replays": REPLAYS,
        "modes": {GREEDY: {"temperature": 0.0}, **MODES},
        "engine_commit": commit,
        "engine_dirty": dirty,
        **versions(),
    }
    path = write_sampling(out, rows, meta)
    return SamplingResult(path, rows, time.monotonic() - t0, meta)
