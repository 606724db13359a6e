"""The sampler and the placeholder scan in isolation (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bubblesim.core.config import SamplingConfig
from engine.outputs import first_placeholder, update_async_output_token_ids
from engine.sampler import Sampler, SampleRows, gumbel_noise

V = 64


def rows(slots, outs, keys, forced=None, hist=()) -> SampleRows:
    i32 = lambda x: torch.tensor(list(x), dtype=torch.int32)  # noqa: E731
    n = len(slots)
    return SampleRows(i32(slots), i32(outs), i32(keys), i32(forced or [-1] * n), i32(hist))


def sample(s: Sampler, logits: torch.Tensor, r: SampleRows) -> list[int]:
    out = torch.empty(logits.shape[0], dtype=torch.int32)
    s.sample(logits.clone(), r, out)
    return out.tolist()


def test_noise_depends_only_on_key_output_index_and_token():
    a = gumbel_noise(7, torch.tensor([3, 5]), torch.tensor([10, 0]), torch.arange(V))
    b = gumbel_noise(7, torch.tensor([5]), torch.tensor([0]), torch.arange(V))
    assert torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    c = gumbel_noise(8, torch.tensor([5]), torch.tensor([0]), torch.arange(V))
    assert not torch.equal(b, c)
    # a subset of token ids gets the same noise as in the full row
    sub = torch.tensor([[4, 9, 63]])
    assert torch.equal(
        gumbel_noise(7, torch.tensor([5]), torch.tensor([0]), sub)[0], b[0, [4, 9, 63]]
    )
    # roughly Gumbel(0, 1): mean ~ 0.577
    big = gumbel_noise(1, torch.arange(64), torch.zeros(64, dtype=torch.long), torch.arange(4096))
    assert abs(big.mean().item() - 0.5772) < 0.02 and torch.isfinite(big).all()


def test_sampled_tokens_do_not_depend_on_batch_composition():
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)
    s = Sampler(cfg, 0, 4, V, torch.device("cpu"))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    together = sample(s, logits, rows([0, 1, 2], [4, 4, 9], [11, 12, 13]))
    alone = [
        sample(s, logits[i : i + 1], rows([3], [o], [k]))[0]
        for i, (o, k) in enumerate([(4, 11), (4, 12), (9, 13)])
    ]
    assert together == alone
    assert s.last_sampled[3].item() == alone[-1]


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.arange(V, dtype=torch.float32).repeat(200, 1) * 0.05
    keys = range(200)
    s = Sampler(SamplingConfig(temperature=1.0, top_k=3), 0, 200, V, torch.device("cpu"))
    got = set(sample(s, logits, rows(range(200), [0] * 200, keys)))
    assert got == {V - 1, V - 2, V - 3}
    peaked = logits.clone()
    peaked[:, 10] = 100.0  # holds all the mass: top-p keeps only it
    s = Sampler(SamplingConfig(temperature=1.0, top_p=0.5), 0, 200, V, torch.device("cpu"))
    assert set(sample(s, peaked, rows(range(200), [0] * 200, keys))) == {10}


def test_greedy_forced_and_penalties():
    cfg = SamplingConfig(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.0)
    s = Sampler(cfg, 0, 2, V, torch.device("cpu"))
    s.init_slot(0, (np.array([5], np.int32), np.array([7, 7], np.int32)), None)
    s.init_slot(1, None, np.array([42, 43], np.int32))
    logits = torch.zeros(2, V)
    logits[:, 5] = 3.0  # in slot 0's prompt: 3 / 2 = 1.5
    logits[:, 7] = 3.0  # sampled twice by slot 0: 3 / 2 - 0.5 * 2 = 0.5
    logits[:, 9] = 2.0
    r = rows([0, 1], [2, 1], [0, 1], forced=[-1, 1 * s.forced_width + 1], hist=[0])
    assert sample(s, logits, r) == [9, 43]  # slot 1 is forced to its output 1
    assert s.counts[0, 9].item() == 1 and s.counts[0, 7].item() == 2
    assert s.counts[1].sum().item() == 0  # no history kept for slot 1
    # re-initialising a slot clears the previous owner's state
    s.init_slot(1, (np.array([1], np.int32), np.array([], np.int32)), None)
    assert (s.forced[1] == -1).all() and s.prompt_mask[1].sum().item() == 1


@pytest.mark.parametrize("reverse", [False, True])
def test_placeholder_scan_before_and_after(reverse):
    out = [3, 4, 5, -1, -1]
    assert first_placeholder(out, reverse) == 3
    assert update_async_output_token_ids(out, [9], reverse) == 1
    assert out == [3, 4, 5, 9, -1]
    assert update_async_output_token_ids(out, [8, 7], reverse) == 1  # only one placeholder left
    assert out == [3, 4, 5, 9, 8]
    assert first_placeholder(out, reverse) == 5
    assert update_async_output_token_ids(out, [1], reverse) == 0
    assert first_placeholder([], reverse) == 0 and first_placeholder([-1], reverse) == 0
