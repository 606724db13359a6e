"""tp_allreduce = "fused" in the simulator and the fit: the messages its size rule sends to the
fused kernel (bubblesim.core.collectives) cost gpu_pass.allreduce_fused's latency + (n - 1) x S
over the link, the rest the ring; a profile key of its own, validated and merged; `replay
allreduce-fit` fits it from a sweep's "fused" rows beside the one-shot key (the run and
fast-forward tests are tests/test_tp_oneshot.py's, over both kernels); on fitted GPU models
(measured with the profile's tp_allreduce) another algorithm adds the difference of the two
algorithms' collectives, and the same algorithm keeps every value to the bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubblesim.core.collectives import FUSED_MAX_BYTES, uses_oneshot
from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import get_model
from bubblesim.core.shape import BatchShape
from replay.__main__ import main as replay_main
from replay.analysis.allreducefit import write_sweep
from sim.cost import CostModel, ProfileError, default_profile, load_profile
from sim.cost.collective import Collectives

RING = {"latency_ms": 0.0118, "latency_ms_per_peer": 0.0, "bw_efficiency": 0.38}
FUSED = {"latency_ms": 0.0053, "bw_efficiency": 0.47}
ONE = {"latency_ms": 0.0094, "bw_efficiency": 0.30}
H100 = get_gpu("h100")


def test_fused_messages_take_the_fused_parameters() -> None:
    for n in (2, 4, 8):
        fused = Collectives(H100, n, RING, FUSED, "fused")
        ring = Collectives(H100, n, RING)
        limit = FUSED_MAX_BYTES[n]
        for nbytes in (512, 8192, limit, limit + 2):
            want = (
                0.0053 + (n - 1) * nbytes / (450e9 * 0.47 / 1e3)
                if uses_oneshot("fused", nbytes, n)
                else ring.allreduce_ms(nbytes)
            )
            assert fused.allreduce_ms(nbytes) == pytest.approx(want, rel=1e-12), (n, nbytes)
    with pytest.raises(ValueError, match="gpu_pass.allreduce_fused"):
        Collectives(H100, 2, RING, None, "fused")


def test_the_cost_model_reads_its_own_key() -> None:
    cfg = Config(model="llama3-8b", tensor_parallel_size=2, tp_allreduce="fused")
    base = CostModel(cfg)
    assert (
        base.collectives.oneshot_latency_ms
        == default_profile()["gpu_pass"]["allreduce_fused"]["latency_ms"]
    )
    cm = CostModel(cfg, {"version": 1, "gpu_pass": {"allreduce_fused": {"latency_ms": 0.001}}})
    assert cm.collectives.oneshot_latency_ms == 0.001
    one = CostModel(Config(model="llama3-8b", tensor_parallel_size=2, tp_allreduce="oneshot"))
    assert one.collectives.oneshot_latency_ms != base.collectives.oneshot_latency_ms
    with pytest.raises(ProfileError, match="gpu_pass.allreduce_fused.bw_efficiency"):
        CostModel(cfg, {"version": 1, "gpu_pass": {"allreduce_fused": {"bw_efficiency": 2.0}}})


def test_fit_writes_the_fused_key_from_fused_rows(tmp_path: Path, capsys) -> None:
    rows = []
    for mode, params in (("graph", None), ("oneshot", ONE), ("fused", FUSED)):
        for n in (2, 4):
            c = Collectives(H100, n, RING, params, mode if params else "nccl")
            for b in [2**k for k in range(10, 24)]:
                if params is not None and not uses_oneshot(mode, b, n):
                    continue
                ms = c.allreduce_ms(b)
                rows.append({"mode": mode, "world_size": n, "bytes": b, "iters": 10,
                             "samples": 5, "ms": ms, "ms_min": ms, "ms_max": ms})  # fmt: skip
    path = write_sweep(tmp_path / "ar.parquet", rows, {"gpu": "h100", "device": "synthetic"})
    assert replay_main(["allreduce-fit", str(path), "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "gpu_pass.allreduce_fused: latency_ms 0.00530" in out and "bytes pushed" in out
    prof = load_profile(tmp_path / "p.json")
    for key, want in (("allreduce_fused", FUSED), ("allreduce_oneshot", ONE)):
        for k, v in want.items():
            assert prof["gpu_pass"][key][k] == pytest.approx(v, rel=1e-6), (key, k)
    assert "allreduce_fused fitted on" in prof["notes"]


DECODE_FIT = {"intercept": 3.0, "num_reqs": 0.004, "kv_read_tokens": 1e-5}


def _fitted(algorithm: str, fit_algorithm: str | None) -> CostModel:
    prof = {"version": 1, "tensor_parallel_size": 2, "gpu_pass": {"decode": dict(DECODE_FIT)}}
    if fit_algorithm is not None:
        prof["tp_allreduce"] = fit_algorithm
    cfg = Config(model="llama3-8b", gpu="h100", tensor_parallel_size=2, tp_allreduce=algorithm)
    return CostModel(cfg, prof)


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_a_fit_measured_with_nccl_gets_the_difference_to_fused(batch: int) -> None:
    s = BatchShape(num_reqs=batch, decode_tokens=batch, kv_read_tokens=600 * batch,
                   attn_pairs=600 * batch, max_kv_tokens=600)  # fmt: skip
    nccl, fused = _fitted("nccl", None), _fitted("fused", None)
    fit_ms = nccl.gpu_pass_ms(s)
    assert fit_ms == _fitted("nccl", "nccl").gpu_pass_ms(s)  # the key's default is nccl
    assert fit_ms == _fitted("fused", "fused").gpu_pass_ms(s)  # measured with its algorithm
    model = get_model("llama3-8b")
    rows = nccl._decode_message_tokens(s)  # a graphed decode all-reduces its captured rows
    msg = rows * model.hidden_size * 2
    ring, kernel = nccl.collectives, fused.collectives
    calls = 2 * model.num_layers
    per_ring = ring.allreduce_ms(batch * model.hidden_size * 2)
    if uses_oneshot("fused", msg, 2):
        per_fused = kernel.oneshot_ms(batch * model.hidden_size * 2)
        want = fit_ms + calls * (per_fused - per_ring)
    else:
        want = fit_ms  # a message over the limit takes the ring either way
    assert fused.gpu_pass_ms(s) == pytest.approx(want, rel=1e-9), batch
    assert (fused.gpu_pass_ms(s) < fit_ms) == uses_oneshot("fused", msg, 2)


def test_the_profile_s_algorithm_validates() -> None:
    with pytest.raises(ProfileError, match="tp_allreduce"):
        _fitted("nccl", "ring")
