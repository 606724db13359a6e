"""The one-shot all-reduce in the simulator (config tp_allreduce = "oneshot"; the run and
fast-forward tests also take "fused", tests/test_tp_fused_sim.py has its own parameters;
sim.cost.collective): a message the shared rule (bubblesim.core.collectives) sends to the kernel
costs latency + (n - 1) x S / (link x efficiency), larger ones the ring; the piece is chosen by
the message the engine all-reduces (a graph's bucket); "nccl" keeps every value to the bit; the
fast-forward stays exact; the profile key validates."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.collectives import ONESHOT_MAX_BYTES, uses_oneshot
from bubblesim.core.config import Config, load_config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import get_model
from bubblesim.core.shape import BatchShape
from bubblesim.core.trace import make_trace, write_trace
from sim.cost import CostModel, ProfileError, default_profile
from sim.cost.collective import Collectives
from sim.cost.linear import add_linear, compile_linear
from sim.cost.terms import GPU_TARGET, term_target
from sim.stepcosts import StepCosts, StepShape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402

RING = {"latency_ms": 0.006, "latency_ms_per_peer": 0.0015, "bw_efficiency": 0.8}
ONE = {"latency_ms": 0.004, "bw_efficiency": 0.6}
H100 = get_gpu("h100")


def _decode(b: int) -> BatchShape:
    return BatchShape(num_reqs=b, decode_tokens=b, kv_read_tokens=900 * b, attn_pairs=900 * b)


def _mixed(prefill: int, decodes: int) -> BatchShape:
    return BatchShape(
        num_reqs=decodes + 1, num_prefill_reqs=1, prefill_tokens=prefill, decode_tokens=decodes,
        kv_read_tokens=prefill + 500 * decodes, attn_pairs=prefill * prefill // 2 + 500 * decodes,
    )  # fmt: skip


def _cost(model: str, tp: int, algorithm: str, *sets: str) -> CostModel:
    base = [f"model={model}", "gpu=h100", f"tensor_parallel_size={tp}"]
    return CostModel(load_config(None, [*base, f"tp_allreduce={algorithm}", *sets]))


def test_allreduce_takes_the_rule_s_algorithm() -> None:
    for n in (2, 4, 8):
        c = Collectives(H100, n, RING, ONE, "oneshot")
        ring = Collectives(H100, n, RING)
        limit = ONESHOT_MAX_BYTES[n]
        for nbytes in (256, 4096, 2**16, limit - 2, limit, limit + 2, 4 * limit):
            want = (
                0.004 + (n - 1) * nbytes / (450e9 * 0.6 / 1e3)
                if uses_oneshot("oneshot", nbytes, n)
                else ring.allreduce_ms(nbytes)
            )
            assert c.allreduce_ms(nbytes) == pytest.approx(want, rel=1e-12), (n, nbytes)
        assert uses_oneshot("oneshot", limit, n) and not uses_oneshot("oneshot", limit + 2, n)
        assert c.allgather_ms(2**20) == ring.allgather_ms(2**20)  # the gather stays NCCL's
    # nccl: the ring at every size, as before; one GPU: free
    assert Collectives(H100, 2, RING, ONE, "nccl").allreduce_ms(1024) == Collectives(
        H100, 2, RING
    ).allreduce_ms(1024)
    assert Collectives(H100, 1, RING, ONE, "oneshot").allreduce_ms(1024) == 0.0
    with pytest.raises(ValueError, match="allreduce_oneshot"):
        Collectives(H100, 2, RING, None, "oneshot")


def test_oneshot_pass_model_and_its_token_limit() -> None:
    m = get_model("llama3-8b")
    token_bytes = m.hidden_size * 2
    for n in (2, 4, 8):
        c = Collectives(H100, n, RING, ONE, "oneshot")
        one = c.oneshot_pass(m, "bfloat16")
        assert one is not None
        # the largest token count whose message the rule sends to the kernel
        assert uses_oneshot("oneshot", one.max_tokens * token_bytes, n)
        assert not uses_oneshot("oneshot", (one.max_tokens + 1) * token_bytes, n)
        for s in (_decode(1), _decode(37), _mixed(one.max_tokens - 5, 5)):
            assert s.num_tokens <= one.max_tokens
            rows = s.decode_tokens + s.num_prefill_reqs
            want = 2 * m.num_layers * c.allreduce_ms(s.num_tokens * token_bytes) + c.allgather_ms(
                rows * m.vocab_size * 2
            )
            got = compile_linear(one.model)(s)
            assert got == pytest.approx(want, rel=1e-9)
    assert Collectives(H100, 2, RING, ONE, "nccl").oneshot_pass(m, "bfloat16") is None
    assert Collectives(H100, 1, RING, ONE, "oneshot").oneshot_pass(m, "bfloat16") is None


def test_nccl_is_the_one_linear_model_to_the_bit() -> None:
    """tp_allreduce "nccl" (the default): roofline + (GPU terms + the ring's pass model) in one
    compiled linear model, the same floats as before the one-shot model existed."""
    prof = default_profile()
    for model, tp in (("llama3-8b", 2), ("llama3-70b", 4), ("llama3.2-3b", 8)):
        cm = _cost(model, tp, "nccl")
        assert cm.collectives.oneshot_pass(cm.model, "bfloat16") is None
        coll = Collectives(H100, tp, prof["gpu_pass"]["allreduce"])
        extra = [prof["terms"][t] for t in cm.active_terms if term_target(t) == GPU_TARGET]
        add = compile_linear(add_linear(add_linear(*extra), coll.pass_model(cm.model, "bfloat16")))
        for s in (_decode(1), _decode(64), _decode(256), _mixed(512, 8), _mixed(3000, 40)):
            assert repr(cm.gpu_pass_ms(s)) == repr(cm.roofline(s) + add(s))


def test_oneshot_lowers_small_passes_and_leaves_large_ones() -> None:
    nccl, one = _cost("llama3-8b", 2, "nccl"), _cost("llama3-8b", 2, "oneshot")
    m, c = nccl.model, one.collectives
    limit = c.oneshot_pass(m, "bfloat16").max_tokens  # 2 MiB / (4096 x 2 B) = 256 tokens
    assert limit == 256
    for s in (_decode(1), _decode(32), _decode(256), _mixed(200, 24)):
        msg = s.num_tokens * m.hidden_size * 2
        saved = 2 * m.num_layers * (nccl.collectives.allreduce_ms(msg) - c.allreduce_ms(msg))
        assert saved > 0
        assert one.gpu_pass_ms(s) == pytest.approx(nccl.gpu_pass_ms(s) - saved, rel=1e-9)
    for s in (_mixed(257, 0), _mixed(2048, 8), _mixed(8000, 100)):  # past the limit: the ring
        assert repr(one.gpu_pass_ms(s)) == repr(nccl.gpu_pass_ms(s))


def test_a_graph_s_bucket_picks_the_algorithm() -> None:
    """llama3.2-3b (hidden 3072) on 4 GPUs: one-shot up to 512 KiB = 85 tokens. A graphed
    step all-reduces its bucket, so the bucket decides: a mixed step of 80 tokens (bucket 128)
    and a decode of 81 (a graph of 96 rows) take the ring; eager, they take the one-shot kernel."""
    graphed = _cost("llama3.2-3b", 4, "oneshot", "cuda_graphs_mixed=true")
    eager = _cost("llama3.2-3b", 4, "oneshot", "cuda_graphs=false")
    ring_g = _cost("llama3.2-3b", 4, "nccl", "cuda_graphs_mixed=true")
    ring_e = _cost("llama3.2-3b", 4, "nccl", "cuda_graphs=false")
    assert graphed.collectives.oneshot_pass(graphed.model, "bfloat16").max_tokens == 85
    for s in (_mixed(76, 4), _decode(81)):
        assert repr(graphed.gpu_pass_ms(s)) == repr(ring_g.gpu_pass_ms(s))
        assert eager.gpu_pass_ms(s) < ring_e.gpu_pass_ms(s)
    # a mixed step of 40 tokens replays bucket 64: one-shot, charged on the bucket's tokens
    s, bucket = _mixed(36, 4), 64
    m = graphed.model
    ar, ring = graphed.collectives, ring_g.collectives
    saved = 2 * m.num_layers * (ring.allreduce_ms(bucket * 6144) - ar.allreduce_ms(bucket * 6144))
    assert graphed.gpu_pass_ms(s) == pytest.approx(ring_g.gpu_pass_ms(s) - saved, rel=1e-9)
    # a decode of 80 replays the graph of 80 rows: one-shot
    assert graphed.gpu_pass_ms(_decode(80)) < ring_g.gpu_pass_ms(_decode(80))


def test_step_costs_const_and_varying_agree_with_oneshot() -> None:
    for sets in ([], ["spec.method=ngram-cpu", "spec.k=3"]):
        cm = _cost("llama3.2-3b", 4, "oneshot", *sets)
        costs = StepCosts(cm, True)
        rng = random.Random(3)
        for b in (1, 8, 81, 85, 88, 200):
            sh = StepShape()
            if sets:
                sh.set_verify(b, 4 * b, 3 * b)
            else:
                sh.set_decode(b)
            const, varying = costs.const(sh, b), costs.varying(b)
            for _ in range(20):
                for name in ("kv_read_tokens", "attn_pairs", "max_kv_tokens", "context_tokens"):
                    setattr(sh, name, rng.randint(0, 10**6))
                c = list(const)
                for i, fn, ms in varying:
                    c[i] = fn(sh) / 1e3 if ms else fn(sh)
                assert repr(c) == repr(costs.all(sh))


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(11)
    n = 50
    arrival = np.sort(rng.uniform(0, 1.5, n))
    t = make_trace(arrival, rng.integers(16, 700, n), rng.integers(1, 120, n))
    return write_trace(t, tmp_path_factory.mktemp("oneshot") / "t.parquet")


@pytest.mark.parametrize(
    "sets",
    [
        ["model=llama3-8b", "tensor_parallel_size=2"],
        ["model=llama3.2-3b", "tensor_parallel_size=4", "cuda_graphs_mixed=true",
         "batches_in_flight=1", "max_num_batched_tokens=256"],
    ],
)  # fmt: skip
@pytest.mark.parametrize("algorithm", ["oneshot", "fused"])
def test_fast_forward_is_exact_with_a_one_kernel_allreduce(
    trace: Path, sets: list[str], algorithm: str
) -> None:
    full = [*sets, "gpu=h100", f"tp_allreduce={algorithm}"]
    a, b = records_without_and_with_fast_forward(full, trace)
    assert_same_records(a, b, " ".join(full))


@pytest.mark.parametrize("algorithm", ["oneshot", "fused"])
def test_sim_run_a_one_kernel_allreduce_is_faster_at_small_batches(
    trace: Path, tmp_path: Path, algorithm: str
) -> None:
    from sim.run import simulate

    base = ["model=llama3-8b", "gpu=h100", "tensor_parallel_size=2"]
    runs = {
        a: simulate(load_config(None, [*base, f"tp_allreduce={a}"]), trace, tmp_path / a).summary
        for a in ("nccl", algorithm)
    }
    assert runs[algorithm]["gpu_ms_mean"] < runs["nccl"]["gpu_ms_mean"]
    assert runs[algorithm]["config"]["tp_allreduce"] == algorithm


def test_profile_key_validates_and_merges() -> None:
    cfg = Config(model="llama3-8b", tensor_parallel_size=2, tp_allreduce="oneshot")
    cm = CostModel(cfg, {"version": 1, "gpu_pass": {"allreduce_oneshot": {"latency_ms": 0.002}}})
    assert cm.collectives.oneshot_latency_ms == 0.002
    eff = default_profile()["gpu_pass"]["allreduce_oneshot"]["bw_efficiency"]
    assert cm.profile["gpu_pass"]["allreduce_oneshot"]["bw_efficiency"] == eff
    for bad, key in (
        ({"bw_efficiency": 1.5}, "bw_efficiency"),
        ({"latency_ms": -1.0}, "latency_ms"),
        ({"latency_ms_per_peer": 0.001}, "latency_ms_per_peer"),
    ):
        with pytest.raises(ProfileError, match=f"gpu_pass.allreduce_oneshot.{key}"):
            CostModel(cfg, {"version": 1, "gpu_pass": {"allreduce_oneshot": bad}})
