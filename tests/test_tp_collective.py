"""Tensor parallelism, GPU pass: the all-reduce / all-gather model (sim.cost.collective), a
rank's roofline, the collectives and the broadcast term in CostModel, and the profile's degree."""

from __future__ import annotations

import itertools

import pytest

from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import get_model
from bubblesim.core.shape import BatchShape
from sim.cost import CostModel, ProfileError, default_profile
from sim.cost.collective import Collectives
from sim.cost.roofline import Roofline

PARAMS = {"latency_ms": 0.006, "latency_ms_per_peer": 0.0015, "bw_efficiency": 0.8}
SIZES = [2**k for k in range(8, 29, 2)]  # 256 B .. 256 MiB
DECODE = BatchShape(num_reqs=32, decode_tokens=32, kv_read_tokens=32_000, attn_pairs=32_000)
MIXED = BatchShape(
    num_reqs=9, num_prefill_reqs=1, prefill_tokens=2048, decode_tokens=8,
    kv_read_tokens=10_000, attn_pairs=2048 * 1024 + 8000,
)  # fmt: skip


def test_allreduce_matches_the_ring_formula() -> None:
    h100 = get_gpu("h100")
    assert h100.link_gb_per_s == 450.0  # NVLink 4: 900 GB/s both ways
    for n, nbytes in itertools.product((2, 4, 8), SIZES):
        c = Collectives(h100, n, PARAMS)
        lat = 0.006 + 0.0015 * (n - 1)
        bw_bytes_per_ms = 450e9 * 0.8 / 1e3
        want = lat + 2 * (n - 1) / n * nbytes / bw_bytes_per_ms
        assert c.allreduce_ms(nbytes) == pytest.approx(want, rel=1e-12)
        assert c.allgather_ms(nbytes) == pytest.approx(
            lat + (n - 1) / n * nbytes / bw_bytes_per_ms, rel=1e-12
        )
    assert Collectives(h100, 1, PARAMS).allreduce_ms(2**20) == 0.0


def test_allreduce_monotone_in_size_and_gpus() -> None:
    for gpu in ("h100", "a100", "l40s"):
        per_n = [Collectives(get_gpu(gpu), n, PARAMS) for n in (2, 4, 8)]
        for c in per_n:
            t = [c.allreduce_ms(b) for b in SIZES]
            assert all(a < b for a, b in zip(t, t[1:]))
        for b in SIZES:
            t = [c.allreduce_ms(b) for c in per_n]
            assert all(x < y for x, y in zip(t, t[1:]))
    # a slower link costs more for the same call
    big = 64 * 2**20
    assert Collectives(get_gpu("l40s"), 4, PARAMS).allreduce_ms(big) > Collectives(
        get_gpu("h100"), 4, PARAMS
    ).allreduce_ms(big)


def test_pass_model_counts_two_allreduces_per_layer_and_a_logits_gather() -> None:
    m, gpu = get_model("llama3-70b"), get_gpu("h100")
    c = Collectives(gpu, 4, PARAMS)
    lin = c.pass_model(m, "bfloat16")
    for s in (DECODE, MIXED):
        rows = s.decode_tokens + s.num_prefill_reqs
        want = 2 * m.num_layers * c.allreduce_ms(s.num_tokens * m.hidden_size * 2) + c.allgather_ms(
            rows * m.vocab_size * 2
        )
        got = sum(lin[k] * (1 if k == "intercept" else getattr(s, k)) for k in lin)
        assert got == pytest.approx(want, rel=1e-9)
    assert Collectives(gpu, 1, PARAMS).pass_model(m, "bfloat16") == {}


def test_cost_model_gpu_pass_is_a_ranks_roofline_plus_collectives() -> None:
    prof = default_profile()
    for tp in (2, 4, 8):
        cm = CostModel(Config(model="llama3-70b", gpu="h100", tensor_parallel_size=tp))
        roof = Roofline(
            get_model("llama3-70b"), get_gpu("h100"), "bfloat16",
            prof["gpu_pass"]["roofline"], tp,
        )  # fmt: skip
        coll = Collectives(get_gpu("h100"), tp, prof["gpu_pass"]["allreduce"])
        for s in (DECODE, MIXED):
            m = get_model("llama3-70b")
            rows = s.decode_tokens + s.num_prefill_reqs
            want = (
                roof(s)
                + 2 * m.num_layers * coll.allreduce_ms(s.num_tokens * m.hidden_size * 2)
                + coll.allgather_ms(rows * m.vocab_size * 2)
            )
            assert cm.gpu_pass_ms(s) == pytest.approx(want, rel=1e-9)


def test_gpu_pass_falls_with_tp_for_a_large_model() -> None:
    times = {
        tp: CostModel(Config(model="llama3-8b", tensor_parallel_size=tp)).gpu_pass_ms(DECODE)
        for tp in (1, 2, 4, 8)
    }
    assert times[1] > times[2] > times[4] > times[8]
    assert times[2] < 0.7 * times[1]  # half the bytes, plus 64 all-reduces of ~10 us


def test_tp1_cost_model_unchanged() -> None:
    """The one-GPU roofline of before: the same numbers (tp=1 shards are the whole model)."""
    m, gpu, prof = get_model("llama3-8b"), get_gpu("h100"), default_profile()
    params = prof["gpu_pass"]["roofline"]
    r = Roofline(m, gpu, "bfloat16", params)
    ms_per_byte = 1e3 / (gpu.hbm_gb_per_s * 1e9 * params["mem_efficiency"])
    assert r.weights_ms == m.decode_weight_bytes("bfloat16") * ms_per_byte
    cm = CostModel(Config(model="llama3-8b"))
    assert cm.gpu_pass_ms(DECODE) == r(DECODE)
    assert cm.broadcast_ms(DECODE) == 0.0
    assert "launch.tp_broadcast" not in cm.active_terms


def test_broadcast_is_charged_to_launch() -> None:
    one = CostModel(Config(model="llama3-8b"))
    two = CostModel(Config(model="llama3-8b", tensor_parallel_size=2))
    b = two.broadcast_ms(MIXED)
    term = default_profile()["terms"]["launch.tp_broadcast"]
    assert b == pytest.approx(
        term["intercept"] + term["num_reqs"] * 9 + term["prefill_tokens"] * 2048, rel=1e-12
    )
    assert two.cpu_phase_ms("launch", MIXED) == pytest.approx(
        one.cpu_phase_ms("launch", MIXED) + b, rel=1e-12
    )
    for phase in ("schedule", "prepare_inputs", "sample", "process_outputs"):
        assert two.cpu_phase_ms(phase, MIXED) == one.cpu_phase_ms(phase, MIXED)


def _fitted(tp: int | None) -> dict:
    prof: dict = {"version": 1, "gpu_pass": {"decode": {"intercept": 1.0, "num_reqs": 0.01}}}
    if tp is not None:
        prof["tensor_parallel_size"] = tp
    return prof


def test_profile_degree_is_checked() -> None:
    cfg2 = Config(model="llama3-8b", tensor_parallel_size=2)
    # fitted GPU times without a degree are one GPU's: refused at tp 2, used at tp 1
    with pytest.raises(ProfileError, match="tensor_parallel_size=1, the config's is 2"):
        CostModel(cfg2, _fitted(None))
    assert CostModel(Config(model="llama3-8b"), _fitted(None)).gpu_pass_ms(DECODE) > 1.0
    assert CostModel(cfg2, _fitted(2)).gpu_pass_ms(DECODE) == pytest.approx(1.32)
    with pytest.raises(ProfileError, match="tensor_parallel_size=4, the config's is 2"):
        CostModel(cfg2, _fitted(4))
    # no fitted GPU model (CPU phases, collectives): any degree
    cpu_only = {"version": 1, "gpu_pass": {"allreduce": {"latency_ms": 0.01}}}
    assert CostModel(cfg2, cpu_only).collectives.latency_ms == pytest.approx(0.0115)
    with pytest.raises(ProfileError, match="key 'tensor_parallel_size'"):
        CostModel(cfg2, {"version": 1, "tensor_parallel_size": 3})
    with pytest.raises(ProfileError, match="bw_efficiency"):
        CostModel(cfg2, {"version": 1, "gpu_pass": {"allreduce": {"bw_efficiency": 1.5}}})
