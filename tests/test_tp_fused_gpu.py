"""tp_allreduce=fused on 2 CUDA GPUs: the all-reduce fused with the residual add and RMSNorm
(engine.kernels.reduce_norm) captured in the decode CUDA graphs and run eagerly in mixed steps.
Its own file: one symmetric-memory group per process (engine.tp.comm.check_symmetric), so the
NCCL engine it is compared with is built first. Skipped with fewer than 2 GPUs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_cfg
from test_tp_gpu import BATCH, forced_requests

from engine.engine import Engine
from engine.requests import RequestInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]


def decode_logits(eng: Engine) -> torch.Tensor:
    eng.run(forced_requests(eng.spec.vocab_size), arrival="asap")
    assert eng.graphs is not None and int(eng.trace.graphed.sum()) > 0
    torch.cuda.synchronize()
    return eng.graphs.logits[eng.graphs.bucket_for(BATCH), False][:BATCH].float().cpu().clone()


def test_fused_matches_nccl_in_graphs_and_eager_steps():
    """The same forced inputs through TP 2 with NCCL's all-reduce, then with the fused kernel:
    the last decode graph's logits agree to bf16 rounding (both sum two bf16 values and round
    once), and unforced requests with 2 in flight, mixed graphs and penalties produce the same
    tokens on the whole (bf16 argmax ties may differ) with exact lengths."""
    kw = dict(device="cuda", model="small", tensor_parallel_size=2, batches_in_flight=2)
    reqs = [RequestInput(f"d{i}", 16 + 8 * i, 24, needs_history=i % 3 == 0) for i in range(8)]
    nccl = Engine(make_cfg(**kw))
    try:
        ref = decode_logits(nccl)
        ref_tokens = [o.token_ids for o in nccl.run(reqs, arrival="asap")]
    finally:
        nccl.close()
    eng = Engine(make_cfg(tp_allreduce="fused", cuda_graphs_mixed=True, **kw))
    try:
        fused = eng.model.comm.fused
        assert fused is not None
        assert fused.takes(torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16), None)
        assert not fused.takes(torch.empty(1024, 4096, device="cuda", dtype=torch.bfloat16), None)
        got = decode_logits(eng)
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 1e-2 * scale, float((got - ref).abs().max() / scale)
        outs = eng.run(reqs, arrival="asap")
    finally:
        eng.close()
    assert [len(o.token_ids) for o in outs] == [24] * 8
    same = np.mean([a == b for o, r in zip(outs, ref_tokens) for a, b in zip(o.token_ids, r)])
    assert same >= 0.9, same
