"""The simulator's cost model (sim.cost): roofline GPU pass, CPU phases, seed terms, profiles."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config, ConfigError, SpecConfig
from bubblesim.core.gpus import GPUS
from bubblesim.core.models import PRESETS
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from sim.cost import (
    DEFAULTS,
    LINEAR_TERMS,
    CostModel,
    ProfileError,
    compile_linear,
    default_profile,
    design_row,
    load_cost_model,
    load_profile,
    save_profile,
    validate_profile,
)
from sim.cost.__main__ import decode_shape, prefill_shape
from sim.cost.linear import evaluate
from sim.cost.model import mixed_graph_tokens

ROOF = DEFAULTS["gpu_pass"]["roofline"]
PHASES_NO_LAUNCH = tuple(p for p in CPU_PHASES if p != "launch")


def model(**kw: object) -> CostModel:
    return CostModel(Config(**kw))  # type: ignore[arg-type]


def spec_model(method: str = "ngram-gpu", **kw: object) -> CostModel:
    return model(spec=SpecConfig(method=method), **kw)


# ---- GPU pass: the roofline ------------------------------------------------------------------
def test_decode_batch1_is_weight_bandwidth_bound():
    cm = model(model="llama3-8b", gpu="h100")
    weights_ms = (
        PRESETS["llama3-8b"].decode_weight_bytes() / (GPUS["h100"].hbm_gb_per_s * 1e9) * 1e3
    )
    t = cm.gpu_pass_ms(decode_shape(1, 1024))
    assert t > weights_ms  # never beats the datasheet
    # weights at the efficiency factor, plus KV and overheads of well under 10 %
    assert t == pytest.approx(weights_ms / ROOF["mem_efficiency"], rel=0.1)
    assert 5.0 < t < 7.0  # public: Llama-8B H100 decode ~5-6 ms per step


def test_decode_grows_with_batch_and_context():
    cm = model(model="llama3-8b")
    by_batch = [cm.gpu_pass_ms(decode_shape(b, 1024)) for b in (1, 8, 64, 256)]
    by_ctx = [cm.gpu_pass_ms(decode_shape(32, c)) for c in (128, 1024, 8192, 65536)]
    assert by_batch == sorted(by_batch) and by_batch[-1] > 1.5 * by_batch[0]
    assert by_ctx == sorted(by_ctx) and by_ctx[-1] > 3 * by_ctx[0]


def test_large_prefill_is_compute_bound():
    cm = model(model="llama3-8b")
    s = prefill_shape(8192)
    assert cm.roofline.compute_ms(s) > 5 * cm.roofline.memory_ms(s)
    m = PRESETS["llama3-8b"]
    body = m.decode_weight_bytes() // 2 - m.vocab_size * m.hidden_size
    flops = 2 * body * 8192 + m.attn_flops(1, 1) * s.attn_pairs
    ideal_ms = flops / (GPUS["h100"].bf16_tflops * 1e12) * 1e3
    t = cm.gpu_pass_ms(s)
    assert ideal_ms / 0.75 < t < ideal_ms / 0.4  # 40-75 % of peak
    # compute-bound: doubling the tokens roughly doubles the time (attention adds a bit)
    assert 1.9 < t / cm.gpu_pass_ms(prefill_shape(4096)) < 2.5


def test_h200_faster_for_memory_bound_decode_not_for_prefill():
    h100, h200 = model(gpu="h100"), model(gpu="h200")
    s = decode_shape(16, 2048)
    speedup = h100.gpu_pass_ms(s) / h200.gpu_pass_ms(s)
    assert 1.3 < speedup <= GPUS["h200"].hbm_gb_per_s / GPUS["h100"].hbm_gb_per_s
    p = prefill_shape(8192)
    assert h200.gpu_pass_ms(p) == pytest.approx(h100.gpu_pass_ms(p), rel=0.02)


def test_verify_pass_of_k_plus_1_tokens_costs_little_more_when_memory_bound():
    plain, spec = model(model="llama3-8b"), spec_model("ngram-gpu", model="llama3-8b")
    base = plain.gpu_pass_ms(decode_shape(8, 1024))
    verify = spec.gpu_pass_ms(decode_shape(8, 1024, k=3))
    assert base < verify < 1.3 * base


def test_small_models_hit_the_launch_floor_and_are_cpu_bound():
    cm = model(model="tiny")
    floor = ROOF["min_ms"] + ROOF["min_ms_per_layer"] * PRESETS["tiny"].num_layers
    for s in (decode_shape(1, 100), decode_shape(64, 1000)):
        assert cm.gpu_pass_ms(s) == pytest.approx(floor)
        cpu = sum(cm.cpu_phase_ms(p, s) for p in CPU_PHASES) + cm.launch_ms(s, True)
        assert cpu > cm.gpu_pass_ms(s)


def test_float32_is_slower_than_bfloat16():
    s = decode_shape(8, 512)
    assert model(dtype="float32").gpu_pass_ms(s) > 1.8 * model().gpu_pass_ms(s)


# ---- CPU phases and launch --------------------------------------------------------------------
def test_cpu_phases_have_nano_vllm_magnitudes_at_batch_64():
    cm = model(model="llama3.2-1b")
    s = decode_shape(64, 1024)
    assert 1.0 <= cm.cpu_phase_ms("prepare_inputs", s) <= 2.0
    assert 0.5 <= cm.cpu_phase_ms("schedule", s) <= 1.0
    assert 0.5 <= cm.cpu_phase_ms("process_outputs", s) <= 1.0
    assert cm.cpu_phase_ms("draft", s) == 0.0  # no spec
    one = decode_shape(1, 1024)
    for p in PHASES_NO_LAUNCH[:-1]:
        assert cm.cpu_phase_ms(p, s) >= cm.cpu_phase_ms(p, one)
    assert cm.cpu_phase_ms("schedule", BatchShape()) > 0  # an empty schedule still costs


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="sync"):
        model().cpu_phase_ms("sync", decode_shape(1, 1))
    with pytest.raises(ValueError, match="bogus"):
        model().alloc_objects("bogus", decode_shape(1, 1))


def test_launch_graph_vs_eager():
    cm8, cm1 = model(model="llama3-8b"), model(model="llama3.2-1b")
    dec, mixed = decode_shape(8, 100), prefill_shape(512)
    graph = cm8.launch_ms(dec, True)
    assert 0.02 < graph < 0.1  # replay ~2.5 us + ~1 ns/node, plus Python buffer copies
    eager = cm8.launch_ms(dec, False)
    assert eager > 20 * graph
    assert cm8.launch_ms(mixed, True) == eager  # prefills and mixed batches run eagerly
    assert cm8.launch_ms(decode_shape(1024, 100), True) == eager  # beyond captured sizes
    assert cm1.launch_ms(dec, False) < eager  # eager cost scales with layers
    assert cm8.cpu_phase_ms("launch", dec) == 0.0  # the phase's residual (launch_ms is apart)


def test_mixed_graphs_what_if_launches_a_graph_and_pays_the_padding():
    """`cuda_graphs_mixed` (engine.mixed_graphs): steps with a prefill replay a graph captured
    for a token bucket; the padding costs the fitted per-token GPU time, the graph's logits
    rows past the step's (min(max_num_seqs, bucket) in all) the roofline's per-row time."""
    fit = {"intercept": 1.0, "num_tokens": 0.003, "kv_read_tokens": 1e-5}
    prof = {"version": 1, "gpu_pass": {"mixed": fit}}
    eager = CostModel(Config(model="llama3.2-1b"), prof)
    graphs = CostModel(Config(model="llama3.2-1b", cuda_graphs_mixed=True), prof)
    mixed, dec = prefill_shape(1000), decode_shape(8, 100)
    assert not eager.graphed(mixed, True) and graphs.graphed(mixed, True)
    assert (
        graphs.launch_ms(mixed, True) == graphs.launch_ms(dec, True) < eager.launch_ms(mixed, True)
    )
    row = graphs.roofline.lm_ms_per_row + graphs.roofline.logits_ms_per_row
    assert 0 < row < 0.01
    rows = 15  # a 16-row graph (bubblesim.core.graph_buckets.mixed_graph_rows), 1 generating
    want = eager.gpu_pass_ms(mixed) + 24 * 0.003 + rows * row
    assert graphs.gpu_pass_ms(mixed) == pytest.approx(want)
    p1024 = prefill_shape(1024)
    assert graphs.gpu_pass_ms(p1024) == pytest.approx(eager.gpu_pass_ms(p1024) + rows * row)
    big = prefill_shape(5000)  # past 512 tokens: multiples of 256 (5120), not 8192
    want = eager.gpu_pass_ms(big) + 120 * 0.003 + rows * row
    assert graphs.gpu_pass_ms(big) == pytest.approx(want)
    assert [mixed_graph_tokens(n) for n in (1, 3, 300, 512, 513, 767, 769)] == [
        1,
        4,
        512,
        512,
        768,
        768,
        1024,
    ]
    assert graphs.gpu_pass_ms(dec) == eager.gpu_pass_ms(dec)  # decode untouched
    many = BatchShape(num_reqs=41, num_prefill_reqs=1, prefill_tokens=400, decode_tokens=40)
    want = eager.gpu_pass_ms(many) + 72 * 0.003 + (256 - 41) * row  # 41 rows: the full graph
    assert graphs.gpu_pass_ms(many) == pytest.approx(want)
    assert not graphs.graphed(mixed, False)  # cuda_graphs off at run time: nothing is graphed
    roof = CostModel(Config(model="llama3.2-1b", cuda_graphs_mixed=True))  # no mixed fit
    assert roof.gpu_pass_ms(mixed) > CostModel(Config(model="llama3.2-1b")).gpu_pass_ms(mixed)
    with pytest.raises(ConfigError, match="cuda_graphs_mixed"):
        Config(cuda_graphs=False, cuda_graphs_mixed=True)


# ---- seed terms ------------------------------------------------------------------------------
def test_seed3_forward_scan_costs_13_ns_per_history_element():
    fwd, rev = model(reverse_placeholder_scan=False), model(reverse_placeholder_scan=True)
    s = BatchShape(num_reqs=128, decode_tokens=128, history_tokens=128 * 60_000)
    base = BatchShape(num_reqs=128, decode_tokens=128)
    assert fwd.cpu_phase_ms("sample", s) - fwd.cpu_phase_ms("sample", base) == pytest.approx(99.84)
    assert rev.cpu_phase_ms("sample", s) == rev.cpu_phase_ms("sample", base)  # O(1) per request
    assert fwd.cpu_phase_ms("sample", s) > 10 * rev.cpu_phase_ms("sample", s)


def test_seed2_cat_costs_three_more_launches_and_a_little_gpu():
    s = decode_shape(16, 1024, k=3)
    by_sum, cat = spec_model(accepted_count_by_sum=True), spec_model(accepted_count_by_sum=False)
    d_cpu = cat.cpu_phase_ms("sample", s) - by_sum.cpu_phase_ms("sample", s)
    d_gpu = cat.gpu_pass_ms(s) - by_sum.gpu_pass_ms(s)
    assert 3 * 0.005 <= d_cpu <= 3 * 0.015
    assert 0.001 <= d_gpu <= 0.02
    plain = decode_shape(16, 1024)  # without spec decoding the switch changes nothing
    assert model(accepted_count_by_sum=False).cpu_phase_ms("sample", plain) == model(
        accepted_count_by_sum=True
    ).cpu_phase_ms("sample", plain)


def test_seed1_backup_list_is_a_small_cpu_delta():
    s = decode_shape(4, 1024, k=3)
    lst, pre = spec_model(preallocated_backup_tokens=False), spec_model()
    d = lst.cpu_phase_ms("draft", s) - pre.cpu_phase_ms("draft", s)
    assert 0.0005 <= d <= 0.003
    assert lst.alloc_objects("draft", s) == pre.alloc_objects("draft", s) == 0  # net 0 by default


def test_seed4_ngram_cpu_grows_with_context_and_gpu_kernel_with_max_model_len():
    cpu = spec_model("ngram-cpu")
    short, long = decode_shape(16, 1000, k=3), decode_shape(16, 60_000, k=3)
    assert cpu.cpu_phase_ms("draft", long) > cpu.cpu_phase_ms("draft", short) + 1.0
    assert cpu.draft_gpu_ms(long) == 0.0
    assert cpu.d2h_sync_ms(short) > 0.0
    g4k, g32k = spec_model(max_model_len=4096), spec_model(max_model_len=32768)
    s = decode_shape(64, 1000, k=3)
    assert g4k.draft_gpu_ms(s) < g32k.draft_gpu_ms(s)
    var4k = g4k.draft_gpu_ms(s) - g4k.draft_gpu_ms(decode_shape(1, 1000, k=3))
    var32k = g32k.draft_gpu_ms(s) - g32k.draft_gpu_ms(decode_shape(1, 1000, k=3))
    assert var32k == pytest.approx(8 * var4k)  # proportional to batch x max_model_len
    more_n = model(spec=SpecConfig(method="ngram-gpu", min_n=1, max_n=6), max_model_len=4096)
    assert more_n.draft_gpu_ms(s) == pytest.approx(2 * g4k.draft_gpu_ms(s))  # 6 n values vs 3
    # the CPU side of the GPU proposer is a launch, independent of context
    assert g4k.cpu_phase_ms("draft", long) == g4k.cpu_phase_ms("draft", short)


def test_seed5_optimistic_adds_correction_kernels_only_when_async():
    s = decode_shape(16, 1024, k=3)
    on, off = spec_model(optimistic_spec_decode=True), spec_model(optimistic_spec_decode=False)
    assert 0.005 < on.gpu_pass_ms(s) - off.gpu_pass_ms(s) < 0.03
    assert on.cpu_phase_ms("prepare_inputs", s) - off.cpu_phase_ms("prepare_inputs", s) > 0.01
    sync_on = spec_model(optimistic_spec_decode=True, batches_in_flight=1)
    assert sync_on.gpu_pass_ms(s) == off.gpu_pass_ms(s)


# ---- GC ----------------------------------------------------------------------------------------
def test_gc_pauses_match_public_data_points():
    cm = model()
    assert cm.gc_pause_ms(0, 700) == pytest.approx(0.07, rel=0.2)
    assert cm.gc_pause_ms(1, 7700) == pytest.approx(0.46, rel=0.2)
    assert cm.gc_pause_ms(2, 2_500_000) == pytest.approx(400, rel=0.1)


def test_alloc_objects_are_ints_per_phase():
    cm = model()
    s = BatchShape(num_reqs=8, decode_tokens=8, new_reqs=3, finished_reqs=1)
    got = {p: cm.alloc_objects(p, s) for p in CPU_PHASES}
    assert all(isinstance(v, int) for v in got.values())
    assert got["schedule"] == 12 and got["process_outputs"] == 0


# ---- linear models and calibration -----------------------------------------------------------
def random_shape(rng: random.Random) -> BatchShape:
    return BatchShape(**{f: rng.randint(0, 5000) for f in SHAPE_FIELDS})


def test_compiled_linear_matches_reference_and_refuses_unknown_terms():
    rng = random.Random(0)
    m = {t: rng.uniform(-1, 1) for t in LINEAR_TERMS}
    fn = compile_linear(m)
    for _ in range(20):
        s = random_shape(rng)
        assert fn(s) == pytest.approx(evaluate(m, s))
    assert compile_linear({})(random_shape(rng)) == 0.0
    with pytest.raises(ValueError, match="num_req"):
        compile_linear({"num_req": 1.0})


def test_calibration_is_plain_least_squares():
    """A fit over design_row recovers a phase model, and the fitted profile reproduces it."""
    cm = model()
    rng = random.Random(1)
    shapes = [random_shape(rng) for _ in range(200)]
    terms = list(LINEAR_TERMS)
    x = np.array([design_row(s, terms) for s in shapes])
    y = np.array([cm.cpu_phase_ms("prepare_inputs", s) for s in shapes])
    w, *_ = np.linalg.lstsq(x, y, rcond=None)
    fitted = {t: float(c) for t, c in zip(terms, w) if abs(c) > 1e-12}
    assert fitted["num_reqs"] == pytest.approx(0.018)
    refit = CostModel(Config(), {"version": 1, "cpu_phases": {"prepare_inputs": fitted}})
    for s in shapes[:10]:
        assert refit.cpu_phase_ms("prepare_inputs", s) == pytest.approx(y[shapes.index(s)])


# ---- profiles --------------------------------------------------------------------------------
def test_default_profile_round_trips(tmp_path: Path):
    p = save_profile(tmp_path / "sub" / "prof.json", default_profile())
    assert load_profile(p) == default_profile()
    assert [f.name for f in p.parent.iterdir()] == ["prof.json"]  # no temp file left
    a, b = model(profile=str(p)), model()
    s = decode_shape(32, 2048)
    assert a.gpu_pass_ms(s) == b.gpu_pass_ms(s)
    assert [a.cpu_phase_ms(q, s) for q in CPU_PHASES] == [b.cpu_phase_ms(q, s) for q in CPU_PHASES]


def test_profile_overrides_defaults(tmp_path: Path):
    prof = {
        "version": 1,
        "gpu": "h100",
        "model": "llama3-8b",
        "dtype": "bfloat16",
        "date": "2026-01-01",
        "source_runs": ["runs/a"],
        "gpu_pass": {
            "roofline": {"mem_efficiency": 0.5},
            "decode": {"intercept": 2.0, "kv_read_tokens": 1e-5},
        },
        "cpu_phases": {"schedule": {"intercept": 1.0}},
        "gc": {"pause_ms": [1.0, 1.0, 1.0]},
    }
    path = save_profile(tmp_path / "p.json", prof)
    cm, base = load_cost_model(Config(profile=str(path))), model()
    s, mixed = decode_shape(10, 100), prefill_shape(100)
    assert cm.gpu_pass_ms(s) == pytest.approx(2.0 + 1e-5 * 1000)  # fitted decode model
    assert cm.gpu_pass_ms(mixed) > base.gpu_pass_ms(mixed)  # roofline at 50 % bandwidth
    assert cm.profile["gpu_pass"]["roofline"]["pnorm"] == ROOF["pnorm"]  # merged key by key
    assert cm.cpu_phase_ms("schedule", s) == 1.0  # a linear model is replaced whole
    assert cm.cpu_phase_ms("sample", s) == base.cpu_phase_ms("sample", s)
    assert cm.gc_pause_ms(2, 0) == 1.0
    assert cm.gc_pause_ms(2, 10) > 1.0  # per-object term kept from the defaults


def test_profile_for_another_gpu_is_refused(tmp_path: Path):
    path = save_profile(tmp_path / "p.json", {"version": 1, "gpu": "h100"})
    with pytest.raises(ProfileError, match="'gpu'"):
        load_cost_model(Config(gpu="h200", profile=str(path)))


BAD_PROFILES = [
    ({"gpu": "h100"}, "version"),
    ({"version": 2}, "version"),
    ({"version": 1, "colour": 1}, "colour"),
    ({"version": 1, "cpu_phases": {"schedule": {"num_req": 1.0}}}, "cpu_phases.schedule.num_req"),
    ({"version": 1, "cpu_phases": {"scheduler": {}}}, "cpu_phases.scheduler"),
    ({"version": 1, "cpu_phases": {"sample": {"intercept": "1"}}}, "cpu_phases.sample.intercept"),
    ({"version": 1, "cpu_phases": {"sample": {"intercept": True}}}, "cpu_phases.sample.intercept"),
    (
        {"version": 1, "gpu_pass": {"roofline": {"mem_efficiency": 1.5}}},
        "gpu_pass.roofline.mem_efficiency",
    ),
    ({"version": 1, "gpu_pass": {"prefill": {}}}, "gpu_pass.prefill"),
    ({"version": 1, "gpu_pass": {"decode": {"x": 1}}}, "gpu_pass.decode.x"),
    ({"version": 1, "launch": {"kernels_per_layer": 2.5}}, "launch.kernels_per_layer"),
    ({"version": 1, "launch": {"graph_ms": -1}}, "launch.graph_ms"),
    ({"version": 1, "terms": {"sample.scan": {}}}, "terms.sample.scan"),
    ({"version": 1, "gc": {"pause_ms": [1, 2]}}, "gc.pause_ms"),
    ({"version": 1, "gc": {"pause_ms_per_object": [1, 2, -3]}}, "gc.pause_ms_per_object[2]"),
    ({"version": 1, "source_runs": "a"}, "source_runs"),
    ({"version": 1, "sync": {"intercept": float("nan")}}, "sync.intercept"),
    ([1, 2], "(top level)"),
]


@pytest.mark.parametrize(("data", "key"), BAD_PROFILES)
def test_bad_profile_names_the_key(tmp_path: Path, data: object, key: str):
    with pytest.raises(ProfileError, match=re.escape(f"key '{key}'")):
        validate_profile(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=str(path)):
        load_cost_model(Config(profile=str(path)))
    with pytest.raises(ProfileError):
        save_profile(tmp_path / "out.json", data)  # type: ignore[arg-type]
    assert not (tmp_path / "out.json").exists()


def test_unreadable_profiles(tmp_path: Path):
    with pytest.raises(ProfileError, match="'profile'.*does not exist"):
        load_cost_model(Config(profile=str(tmp_path / "none.json")))
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


# ---- cheap and torch-free ----------------------------------------------------------------------
def test_import_does_not_load_torch():
    code = (
        "import sys, sim.cost\n"
        "from bubblesim.core.config import Config\n"
        "sim.cost.load_cost_model(Config())\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "False"
