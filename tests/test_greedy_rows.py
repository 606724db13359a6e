"""The greedy sampling kernel's bounds, checked on CPU.

On CUDA at temperature 0 the sampler's `sample` / `sample_graph` run a Triton kernel whose
workspace holds num_slots + 1 rows (engine.kernels.sampling); its wrapper asserts the logits fit
(`check_greedy_args`: rows, vocab, unit stride). CPU samplers have no workspace, so the
`greedy_calls` fixture gives them one of the same size and a stand-in kernel: the wrapper's own
check, then torch. Speculative decoding's k + 1 verification rows per request must never go
there: the engine's start-up profiling once sampled max_num_seqs x (k + 1) rows with `sample`,
which failed the check on CUDA whenever num_kv_blocks was left to the profiling.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_cfg, spec_cfg

import engine.kernels.sampling as ks
from engine.engine import Engine
from engine.sampler import Sampler, SampleRows
from replay.gpu.shapes import sweep

K = 3
PENALTY = (("repetition_penalty", 1.2),)  # every row with history: the penalties' paths too


@pytest.fixture
def greedy_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Samplers at temperature 0 get the CUDA greedy workspace on CPU too; the kernel runs as
    its argument check + torch. Returns the row counts the kernel was called with."""
    calls: list[int] = []
    init = Sampler.__init__

    def init_with_workspace(self: Sampler, cfg, seed, num_slots, vocab, device, *a, **kw):
        init(self, cfg, seed, num_slots, vocab, device, *a, **kw)
        if self.greedy_ws is None and cfg.temperature == 0:
            self.greedy_ws = ks.GreedyWorkspace(num_slots + 1, vocab, device)

    def greedy_on_cpu(logits, forced, slots, out, last_sampled, ws) -> None:
        ks.check_greedy_args(logits, ws)
        calls.append(logits.shape[0])
        tok = torch.where(forced >= 0, forced, logits.argmax(dim=-1).to(torch.int32))
        out.copy_(tok)
        last_sampled[slots.long()] = tok

    monkeypatch.setattr(Sampler, "__init__", init_with_workspace)
    monkeypatch.setattr(ks, "greedy_sample", greedy_on_cpu)
    return calls


def _largest_step_logits(eng: Engine) -> torch.Tensor:
    """Logits of the largest step's sampled rows, as the profiling run makes them."""
    g = eng.cfg.max_num_seqs * eng.q
    return torch.randn((g, eng.spec.vocab_size), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", [None, "ngram-gpu", "ngram-cpu"])
@pytest.mark.parametrize("sampling", [None, PENALTY], ids=["plain", "penalties"])
def test_profiling_samples_on_a_steps_path(greedy_calls: list[int], method, sampling):
    """The start-up profiling's sampling: plain decoding's max_num_seqs rows through the
    greedy kernel, spec verification's max_num_seqs x (k + 1) rows never."""
    cfg = make_cfg(sampling)
    if method is not None:
        cfg = spec_cfg(method, K, sampling=sampling)
    eng = Engine(cfg)
    assert eng.sampler.greedy_ws is not None  # the fixture's CUDA-like sampler
    eng._profile_sample(_largest_step_logits(eng))
    assert greedy_calls == ([] if method else [cfg.max_num_seqs])


def test_verification_rows_overflow_the_greedy_workspace(greedy_calls: list[int]):
    """What the profiling did before: `Sampler.sample` over max_num_seqs x (k + 1) rows fails
    the kernel's check (the GPU's AssertionError, here on CPU)."""
    eng = Engine(spec_cfg("ngram-gpu", K))
    logits = _largest_step_logits(eng)
    r = torch.arange(logits.shape[0], dtype=torch.int32)
    rows = SampleRows(r % eng.cfg.max_num_seqs, r * 0, r, r * 0 - 1, r, forced_tok=r * 0 - 1)
    n = eng.cfg.max_num_seqs
    with pytest.raises(AssertionError, match=f"logits {n * (K + 1)} x 512 .* of {n + 1} rows"):
        eng.sampler.sample(logits, rows, torch.empty_like(r))
    assert greedy_calls == []


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "ngram-gpu"])
def test_sweep_batches_keep_to_the_greedy_workspace(greedy_calls: list[int], tmp_path, method):
    """A decode sweep's synthetic batches (the GPU spec test's grid, smaller) sample within the
    kernel's bounds: plain decoding through it, at most max_num_seqs rows; spec verification
    (k drafts, 0..k and mixed widths) never through it."""
    cfg = make_cfg(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096)
    if method is not None:
        cfg = cfg.replace(**{"spec.method": method, "spec.k": K})  # type: ignore[arg-type]
    res = sweep(cfg, tmp_path / "s.parquet", repeats=1, kinds=("decode",), points=12)
    assert res.complete and res.dropped_shapes == 0
    if method is None:
        assert greedy_calls and max(greedy_calls) <= cfg.max_num_seqs
    else:
        assert greedy_calls == []
