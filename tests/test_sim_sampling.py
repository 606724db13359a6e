"""Random sampling's cost over greedy (sim.cost.sampling): the mode rule, the row tables, the
profile key's checks and where CostModel charges it."""

from __future__ import annotations

import re

import pytest

from bubblesim.core.config import load_config
from bubblesim.core.phases import SAMPLE
from bubblesim.core.shape import BatchShape
from sim.cost import CostModel
from sim.cost.defaults import DEFAULTS
from sim.cost.profile import ProfileError, validate_profile
from sim.cost.sampling import GREEDY, MODES, RowTable, mode_of, mode_tables

VOCAB = 128256


def _shape(**kw: int) -> BatchShape:
    base = dict.fromkeys(BatchShape.__dataclass_fields__, 0)
    base.update(kw)
    return BatchShape(**base)


def _decode(b: int, drafts: int = 0, kv: int = 4096) -> BatchShape:
    return _shape(
        num_reqs=b, decode_tokens=b * (1 + drafts), draft_tokens=b * drafts,
        kv_read_tokens=b * kv, attn_pairs=b * kv, max_kv_tokens=kv, context_tokens=b * kv,
    )  # fmt: skip


def _mixed(decodes: int, prompt: int) -> BatchShape:
    return _shape(
        num_reqs=decodes + 1, num_prefill_reqs=1, prefill_tokens=prompt, decode_tokens=decodes,
        kv_read_tokens=decodes * 1000 + prompt, attn_pairs=decodes * 1000 + prompt,
        max_kv_tokens=prompt, context_tokens=decodes * 1000 + prompt,
    )  # fmt: skip


def _model(*sets: str, profile: dict | None = None) -> CostModel:
    return CostModel(load_config(None, ["model=llama3.2-1b", *sets]), profile)


@pytest.mark.parametrize(
    ("t", "k", "p", "mode"),
    [
        (0.0, 50, 0.9, GREEDY),  # temperature 0 is greedy whatever else is set
        (0.8, 0, 1.0, "random"),
        (0.8, 50, 1.0, "top_k"),
        (0.8, 0, 0.95, "top_p"),
        (0.8, 50, 0.95, "top_k_top_p"),
        (0.8, VOCAB, 1.0, "random"),  # a top_k of the whole vocabulary is off (engine.sampler)
        (0.8, VOCAB + 5, 0.9, "top_p"),
    ],
)
def test_mode_of(t: float, k: int, p: float, mode: str) -> None:
    assert mode_of(t, k, p, VOCAB) == mode


def test_row_table_interpolates_and_extends_the_last_slope() -> None:
    t = RowTable([1, 4, 8], [1.0, 4.0, 6.0])
    assert t(0) == 1.0 and t(1) == 1.0  # below the first point: its value
    assert t(2) == pytest.approx(2.0)
    assert t(6) == pytest.approx(5.0)
    assert t(8) == 6.0
    assert t(16) == pytest.approx(6.0 + 0.5 * 8)  # the last two points' slope past the end


def test_mode_tables_scale_with_the_vocabulary() -> None:
    table = DEFAULTS["sampling"]
    full = mode_tables(table, "top_p", VOCAB)
    half = mode_tables(table, "top_p", VOCAB // 2)
    assert full is not None and half is not None
    for key in ("gpu_ms", "host_ms", "spec_gpu_ms", "spec_host_ms"):
        assert half[key](64) == pytest.approx(full[key](64) / 2)
    assert mode_tables(table, GREEDY, VOCAB) is None


def _profile(sampling: object) -> dict:
    return {"version": 1, "sampling": sampling}


@pytest.mark.parametrize(
    ("sampling", "key"),
    [
        ([1, 2], "sampling"),
        ({"rows": [1, 2]}, "sampling.vocab"),
        ({"vocab": 100}, "sampling.rows"),
        ({"vocab": 0, "rows": [1]}, "sampling.vocab"),
        ({"vocab": 100, "rows": [1, 1]}, "sampling.rows[1]"),
        ({"vocab": 100, "rows": [0, 1]}, "sampling.rows[0]"),
        ({"vocab": 100, "rows": [1], "top_q": {}}, "sampling.top_q"),
        ({"vocab": 100, "rows": [1]}, "sampling.random"),
        ({"vocab": 100, "rows": [1], "random": {"gpu_ms": [1.0]}}, "sampling.random.host_ms"),
        (
            {
                "vocab": 100,
                "rows": [1, 2],
                "random": {
                    "gpu_ms": [1.0],
                    "host_ms": [1, 1],
                    "spec_gpu_ms": [1, 1],
                    "spec_host_ms": [1, 1],
                },
            },
            "sampling.random.gpu_ms",
        ),  # fmt: skip
        (
            {
                "vocab": 100,
                "rows": [1],
                "random": {
                    "gpu_ms": ["x"],
                    "host_ms": [1],
                    "spec_gpu_ms": [1],
                    "spec_host_ms": [1],
                },
            },
            "sampling.random.gpu_ms[0]",
        ),  # fmt: skip
    ],
)
def test_bad_sampling_tables_name_their_key(sampling: object, key: str) -> None:
    with pytest.raises(ProfileError, match=re.escape(f"key '{key}'")):
        validate_profile(_profile(sampling))


def test_the_defaults_hold_every_mode() -> None:
    validate_profile(_profile(DEFAULTS["sampling"]))
    assert set(MODES) <= set(DEFAULTS["sampling"])


def test_greedy_adds_nothing() -> None:
    greedy = _model()
    assert greedy._sampling is None and greedy.sampling_mode == GREEDY
    # top_p without a temperature is still greedy (the engine's argmax)
    assert _model("sampling.top_p=0.5")._sampling is None


_TOP_P = {"gpu_ms": [0.5, 2.0, 4.0], "host_ms": [0.6, 0.6, 0.6],
          "spec_gpu_ms": [0.4, 1.9, 3.9], "spec_host_ms": [0.7, 0.7, 0.7]}  # fmt: skip
# round numbers: what each step gets is checkable by hand (top_k: half of top_p's)
SMALL = {
    "vocab": VOCAB,
    "rows": [1, 64, 128],
    **{m: _TOP_P for m in MODES if m != "top_k"},
    "top_k": {k: [x / 2 for x in v] for k, v in _TOP_P.items()},
}


def test_gpu_and_host_terms_where_the_engine_pays_them() -> None:
    prof = {"version": 1, "sampling": SMALL}
    greedy = _model(profile=prof)
    top_p = _model("sampling.temperature=0.8", "sampling.top_p=0.9", profile=prof)
    # a graphed decode of 40 requests samples its bucket's 40 rows (engine.graphs)
    d = _decode(40)
    assert top_p.graphed(d, True)
    want = 0.5 + (40 - 1) * (2.0 - 0.5) / 63
    assert top_p.gpu_pass_ms(d) - greedy.gpu_pass_ms(d) == pytest.approx(want)
    # its sampling is inside the graph: the sample phase is greedy's
    assert top_p.cpu_phase_ms(SAMPLE, d) == greedy.cpu_phase_ms(SAMPLE, d)
    # an eager mixed step samples its 11 rows after the forward: GPU and host
    m = _mixed(10, 900)
    assert not top_p.graphed(m, True)
    want_m = 0.5 + (11 - 1) * 1.5 / 63
    assert top_p.gpu_pass_ms(m) - greedy.gpu_pass_ms(m) == pytest.approx(want_m)
    assert top_p.cpu_phase_ms(SAMPLE, m) - greedy.cpu_phase_ms(SAMPLE, m) == pytest.approx(0.6)
    # past the last point: the last slope
    big = _decode(256)
    extra = top_p.gpu_pass_ms(big) - greedy.gpu_pass_ms(big)
    assert extra == pytest.approx(4.0 + (256 - 128) * 2.0 / 64)


def test_speculative_steps_sample_k_plus_one_rows_outside_the_graph() -> None:
    prof = {"version": 1, "sampling": SMALL}
    sets = ("spec.method=ngram-gpu", "spec.k=3")
    greedy = _model(*sets, profile=prof)
    top_p = _model(*sets, "sampling.temperature=0.8", "sampling.top_p=0.9", profile=prof)
    v = _decode(16, drafts=3)
    assert top_p.graphed(v, True)
    want = 0.4 + (64 - 1) * 1.5 / 63  # 16 x 4 rows on the verify path's table
    assert top_p.gpu_pass_ms(v) - greedy.gpu_pass_ms(v) == pytest.approx(want)
    assert top_p.cpu_phase_ms(SAMPLE, v) - greedy.cpu_phase_ms(SAMPLE, v) == pytest.approx(0.7)


def test_the_host_term_follows_host_scale() -> None:
    prof = {"version": 1, "sampling": SMALL}
    sets = ("sampling.temperature=0.8", "sampling.top_p=0.9", "cuda_graphs=false")
    one = _model(*sets, profile=prof)
    slow = _model(*sets, "host_scale=1.5", profile=prof)
    d = _decode(8)
    greedy_one = _model("cuda_graphs=false", profile=prof).cpu_phase_ms(SAMPLE, d)
    greedy_slow = _model("cuda_graphs=false", "host_scale=1.5", profile=prof).cpu_phase_ms(
        SAMPLE, d
    )
    assert one.cpu_phase_ms(SAMPLE, d) - greedy_one == pytest.approx(0.6)
    assert slow.cpu_phase_ms(SAMPLE, d) - greedy_slow == pytest.approx(0.9)
    assert slow.gpu_pass_ms(d) == one.gpu_pass_ms(d)  # the GPU's time is no host's


def test_a_profile_table_replaces_the_defaults() -> None:
    sets = ["model=llama3.2-1b", "sampling.temperature=0.8", "sampling.top_k=50"]
    own = CostModel(load_config(None, sets), {"version": 1, "sampling": SMALL})
    built_in = CostModel(load_config(None, sets))
    assert own._sampling is not None and built_in._sampling is not None
    assert own._sampling["gpu_ms"](64) == 1.0
    assert built_in._sampling["gpu_ms"](64) == DEFAULTS["sampling"]["top_k"]["gpu_ms"][6]
