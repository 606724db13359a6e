"""Piecewise GPU pass terms (sim/cost/table.py): a bilinear decode table and a linear spline,
their extrapolation rule, validation (one ProfileError naming the key), compilation into one
cheap function (also inside a max form with the straggler branch), fast-forward equality with
a table profile, and the profile's envelope (sim/cost/envelope.py, summary `cost_envelope`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.cli import run_main
from bubblesim.core.config import Config, load_config
from bubblesim.core.runfmt import load_run
from bubblesim.core.shape import BatchShape
from sim.__main__ import main as sim_main
from sim.cost import CostModel, ProfileError, load_profile, save_profile, validate_profile
from sim.cost.envelope import outside_share
from sim.cost.table import spline_values, spline_weights, table_values, table_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402
from test_sim_max_kv import _mixed_trace  # noqa: E402

XS = [1.0, 8.0, 32.0, 128.0]
YS = [128.0, 1024.0, 8192.0]


def bilinear(x: float, y: float) -> float:
    """A function the table reproduces exactly: weights + GEMM rows + KV stream (x * y)."""
    return 1.0 + 0.01 * x + 2e-5 * y + 1e-4 * x * y


TABLE = {"x": "num_tokens", "y": "kv_per_token", "xs": XS, "ys": YS,
         "ms": [[bilinear(x, y) for y in YS] for x in XS]}  # fmt: skip
SPLINE = {"x": "num_tokens", "knots": [16.0, 256.0, 4096.0], "ms": [1.0, 1.5, 17.5]}


def _cm(gpu_pass: dict, *sets: str) -> CostModel:
    cfg = load_config(None, ["model=llama3.2-1b", "gpu=h100", *sets])
    return CostModel(cfg, {"version": 1, "gpu_pass": gpu_pass})


def _decode(b: int, kv_per_req: int, drafts: int = 0) -> BatchShape:
    return BatchShape(num_reqs=b, decode_tokens=b * (1 + drafts), draft_tokens=b * drafts,
                      kv_read_tokens=b * kv_per_req, max_kv_tokens=kv_per_req)  # fmt: skip


def test_table_interpolates_and_extrapolates_by_the_rule() -> None:
    fn = _cm({"decode": {"table": TABLE}}).gpu_decode_ms_fn()
    for b, kv in ((1, 128), (5, 300), (20, 5000), (100, 8000), (128, 1024)):
        assert fn(_decode(b, kv)) == pytest.approx(bilinear(b, kv), rel=1e-12)
    # above the last value: the edge segment continues (linear in KV, linear in rows)
    assert fn(_decode(300, 20000)) == pytest.approx(bilinear(300, 20000), rel=1e-12)
    # below the first value: the edge value holds
    assert fn(_decode(8, 10)) == pytest.approx(bilinear(8, 128), rel=1e-12)
    # a verify step of k=3: 4 query rows per request, each reading a quarter of the KV
    s = _decode(10, 2000, drafts=3)
    assert fn(s) == pytest.approx(bilinear(40, 500), rel=1e-12)
    # the numpy form (calibration, reports) follows the same rule
    shapes = [_decode(b, kv) for b, kv in ((5, 300), (300, 20000), (8, 10))]
    cols = {f: np.array([getattr(s, f) for s in shapes], float)
            for f in ("num_tokens", "num_reqs", "kv_read_tokens")}  # fmt: skip
    np.testing.assert_allclose(table_values(TABLE, cols), [fn(s) for s in shapes], rtol=1e-12)
    # ... and so do the weights a calibration fits the cells with
    x, y = cols["num_tokens"], cols["kv_read_tokens"] / cols["num_tokens"]
    w = table_weights(XS, YS, x, y)
    np.testing.assert_allclose(w @ np.ravel(TABLE["ms"]), table_values(TABLE, cols), rtol=1e-12)


def test_spline_with_linear_attention_terms_for_mixed_steps() -> None:
    mixed = {"spline": SPLINE, "attn_pairs": 1e-9, "num_prefill_reqs": 0.1}
    cm = _cm({"mixed": mixed})
    s = BatchShape(num_reqs=2, num_prefill_reqs=1, prefill_tokens=2176, decode_tokens=1,
                   kv_read_tokens=3000, attn_pairs=10**6)  # fmt: skip
    # 2177 tokens: halfway between the knots 256 and 4096 -> 1.5 + 0.5 * 16
    want = 1.5 + (2177 - 256) / (4096 - 256) * 16.0 + 1e-9 * 10**6 + 0.1
    assert cm.gpu_pass_ms(s) == pytest.approx(want, rel=1e-12)
    tiny = BatchShape(num_reqs=1, num_prefill_reqs=1, prefill_tokens=4, kv_read_tokens=4)
    assert cm.gpu_pass_ms(tiny) == pytest.approx(1.0 + 0.1)  # clamped below the first knot
    big = BatchShape(num_reqs=1, num_prefill_reqs=1, prefill_tokens=8192, kv_read_tokens=8192)
    assert cm.gpu_pass_ms(big) == pytest.approx(17.5 + 16.0 / 3840 * 4096 + 0.1)
    cols = {"num_tokens": np.array([2177.0, 4.0, 8192.0])}
    np.testing.assert_allclose(
        spline_values(SPLINE, cols), [want - 1e-3 - 0.1, 1.0, 17.5 + 16.0 / 3840 * 4096]
    )
    w = spline_weights(SPLINE["knots"], cols["num_tokens"])
    np.testing.assert_allclose(w @ np.array(SPLINE["ms"]), spline_values(SPLINE, cols))


def test_table_in_a_max_form_and_with_gpu_terms() -> None:
    strag = {"spline": {"x": "num_tokens", "knots": XS, "ms": [1.0 + 0.01 * x for x in XS]},
             "program_keys": 2e-3}  # fmt: skip
    fn = _cm({"decode": {"max": [{"table": TABLE}, strag]}}).gpu_decode_ms_fn()
    even = _decode(64, 2000)
    assert fn(even) == pytest.approx(bilinear(64, 2000), rel=1e-12)  # the KV stream wins
    # 40 short requests + one of 38k: the 8-way split program walks 4800 keys
    long = BatchShape(num_reqs=41, decode_tokens=41, kv_read_tokens=38000 + 40 * 500,
                      max_kv_tokens=38000)  # fmt: skip
    assert fn(long) == pytest.approx(1.0 + 0.01 * 41 + 2e-3 * 4800, rel=1e-12)
    # gpu.* terms (speculative decoding) are added to every branch of a table model
    spec = _cm({"decode": {"table": TABLE}}, "spec.method=ngram-gpu")
    base = _cm({"decode": {"table": TABLE}})
    extra = spec.gpu_pass_ms(_decode(8, 512, drafts=3)) - base.gpu_pass_ms(_decode(8, 512, 3))
    assert extra > 0 and extra == pytest.approx(
        sum(
            spec.profile["terms"][t].get("intercept", 0.0)
            for t in spec.active_terms
            if t.startswith("gpu.")
        )  # fmt: skip
    )


def test_a_table_call_costs_a_few_microseconds() -> None:
    fn = _cm({"decode": {"table": TABLE}}).gpu_decode_ms_fn()
    s = _decode(40, 1500)
    best = np.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20000):
            fn(s)
        best = min(best, (time.perf_counter() - t0) / 20000)
    assert best < 5e-6, f"{best * 1e6:.2f} us per call"


@pytest.mark.parametrize(
    ("gpu_pass", "key"),
    [
        ({"decode": {"table": {**TABLE, "bogus": 1}}}, "gpu_pass.decode.table.bogus"),
        ({"decode": {"table": {**TABLE, "y": "kv"}}}, "gpu_pass.decode.table.y"),
        ({"decode": {"table": {**TABLE, "xs": [1, 8, 8, 128]}}}, "gpu_pass.decode.table.xs[2]"),
        ({"decode": {"table": {**TABLE, "xs": [1]}}}, "gpu_pass.decode.table.xs"),
        ({"decode": {"table": {**TABLE, "ms": TABLE["ms"][:3]}}}, "gpu_pass.decode.table.ms"),
        ({"decode": {"table": {**TABLE, "ms": [*TABLE["ms"][:3], [1, 2, -3]]}}},
         "gpu_pass.decode.table.ms[3][2]"),
        ({"decode": {"table": {k: v for k, v in TABLE.items() if k != "ys"}}},
         "gpu_pass.decode.table.ys"),
        ({"decode": {"max": [{"table": TABLE}, {"table": {**TABLE, "ms": [[1, 2, 3]] * 3}}]}},
         "gpu_pass.decode.max[1].table.ms"),
        ({"decode": {"table": TABLE, "spline": SPLINE}}, "gpu_pass.decode.spline"),
        ({"decode": {"table": TABLE, "bogus": 1.0}}, "gpu_pass.decode.bogus"),
        ({"mixed": {"spline": {**SPLINE, "x": "nope"}}}, "gpu_pass.mixed.spline.x"),
        ({"mixed": {"spline": {**SPLINE, "ms": [1.0, "a", 2.0]}}}, "gpu_pass.mixed.spline.ms[1]"),
        ({"mixed": {"spline": {**SPLINE, "knots": [16, 8, 32]}}},
         "gpu_pass.mixed.spline.knots[1]"),
        ({"mixed": {"spline": 3}}, "gpu_pass.mixed.spline"),
    ],
)  # fmt: skip
def test_bad_tables_get_one_error_naming_the_key(gpu_pass: dict, key: str) -> None:
    with pytest.raises(ProfileError) as e:
        validate_profile({"version": 1, "gpu_pass": gpu_pass}, "p.json")
    assert f"key '{key}'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"prefill": {}}, "envelope.prefill"),
        ({"decode": {"num_reqs": [5, 1]}}, "envelope.decode.num_reqs"),
        ({"decode": {"num_reqs": [1, float("nan")]}}, "envelope.decode.num_reqs"),
        ({"decode": {"bogus": [1, 2]}}, "envelope.decode.bogus"),
        ([1, 2], "envelope"),
    ],
)
def test_bad_envelopes_get_one_error_naming_the_key(env: object, key: str) -> None:
    with pytest.raises(ProfileError) as e:
        validate_profile({"version": 1, "envelope": env})
    assert f"key '{key}'" in str(e.value)


def test_table_profile_round_trips(tmp_path: Path) -> None:
    prof = {"version": 1, "gpu_pass": {"decode": {"table": TABLE}, "mixed": {"spline": SPLINE}},
            "envelope": {"decode": {"num_reqs": [1, 128]}}}  # fmt: skip
    p = save_profile(tmp_path / "t.json", prof)
    assert load_profile(p) == prof
    cm = CostModel(Config(model="llama3.2-1b", gpu="h100", profile=str(p)), load_profile(p))
    assert cm.envelope == {"decode": {"num_reqs": [1, 128]}}
    assert cm.gpu_pass_ms(_decode(20, 5000)) == pytest.approx(bilinear(20, 5000))


def test_fast_forward_equals_the_step_loop_with_a_table_profile(tmp_path: Path) -> None:
    """The table reads kv_read_tokens (VARYING): the fast-forwards must call it per step."""
    trace = _mixed_trace(tmp_path, 5)
    table = {**TABLE, "ms": [[1.0 + 0.01 * x + 3e-4 * x * y for y in YS] for x in XS]}
    strag = {"intercept": 1.0, "num_tokens": 0.01, "program_keys": 2e-3}
    mixed = {"spline": {**SPLINE, "ms": [3.0, 4.0, 30.0]}, "attn_pairs": 1e-9}
    outs = {}
    for name, decode in (("table", {"max": [{"table": table}, strag]}), ("plain", strag)):
        prof = {"version": 1, "gpu_pass": {"decode": decode, "mixed": mixed}}
        if name == "table":  # spec verify steps through their own table
            doubled = [[2 * v for v in row] for row in table["ms"]]
            prof["gpu_pass"]["verify"] = {"table": {**table, "ms": doubled}}
        path = save_profile(tmp_path / f"{name}.json", prof)
        for extra in ([], ["spec.method=ngram-gpu", "spec.k=2"]):
            sets = ["model=llama3.2-1b", "gpu=h100", f"profile={path}", *extra]
            outs[name, len(extra)] = records_without_and_with_fast_forward(sets, trace)
            assert_same_records(*outs[name, len(extra)], f"{name} {extra}")
    assert not np.array_equal(outs["table", 0][1].gpu_end, outs["plain", 0][1].gpu_end)


def test_verify_steps_take_the_verify_model() -> None:
    verify = {"table": {**TABLE, "ms": [[2 * bilinear(x, y) for y in YS] for x in XS]}}
    cm = _cm({"decode": {"table": TABLE}, "verify": verify}, "spec.method=ngram-gpu")
    base = _cm({"decode": {"table": TABLE}}, "spec.method=ngram-gpu")
    gpu_terms = base.gpu_pass_ms(_decode(10, 2000, drafts=3)) - bilinear(40, 500)
    assert cm.gpu_pass_ms(_decode(10, 2000, drafts=3)) == pytest.approx(
        2 * bilinear(40, 500) + gpu_terms
    )
    fn = cm.gpu_decode_ms_fn()
    assert fn(_decode(10, 2000)) == base.gpu_decode_ms_fn()(_decode(10, 2000))  # no drafts
    with pytest.raises(ProfileError, match="gpu_pass.verify.table.xs"):
        validate_profile({"version": 1, "gpu_pass": {"verify": {"table": {**TABLE, "xs": 1}}}})


def test_sim_run_reports_steps_outside_the_envelope(tmp_path: Path, capsys) -> None:
    trace = _mixed_trace(tmp_path, 2)
    env = {"decode": {"num_reqs": [1, 4], "kv_per_req": [0, 1e9]},
           "mixed": {"prefill_tokens": [0, 10**6]}}  # fmt: skip
    prof = save_profile(tmp_path / "e.json", {"version": 1, "envelope": env})
    out = tmp_path / "run"
    run_main(sim_main, ["run", str(trace), "--set", f"profile={prof}", "-o", str(out), "-q"])
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    got = summary["cost_envelope"]
    steps = load_run(out).arrays("steps")  # the run format's reader (encoded columns)
    n = np.array(steps["num_reqs"])
    dec = (np.array(steps["num_prefill_reqs"]) == 0) & (n > 0)
    gpu = (np.array(steps["gpu_end_s"]) - np.array(steps["gpu_start_s"])) * 1e3
    off = dec & (n > 4)
    assert got["decode"]["steps"] == int(dec.sum())
    assert got["decode"]["steps_outside"] == pytest.approx(off.sum() / dec.sum())
    assert got["decode"]["gpu_time_outside"] == pytest.approx(gpu[off].sum() / gpu[dec].sum())
    assert 0 < got["decode"]["steps_outside"] < 1 and got["mixed"]["steps_outside"] == 0
    assert "outside the profile's measured envelope" in printed and "of decode steps" in printed
    # a profile without an envelope: no key, no line
    plain = save_profile(tmp_path / "p.json", {"version": 1})
    run_main(sim_main, ["run", str(trace), "--set", f"profile={plain}", "-o", str(tmp_path / "r2"),
                        "-q"])  # fmt: skip
    assert "envelope" not in capsys.readouterr().out
    assert "cost_envelope" not in json.loads((tmp_path / "r2" / "summary.json").read_text())


def test_outside_share_of_an_empty_kind_is_zero() -> None:
    cols = {f: np.zeros(0) for f in ("num_reqs", "num_prefill_reqs", "kv_read_tokens")}
    got = outside_share({"mixed": {"num_reqs": [1, 2]}}, cols, np.zeros(0))
    assert got == {"mixed": {"steps": 0, "steps_outside": 0.0, "gpu_time_outside": 0.0}}
