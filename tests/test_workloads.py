"""bubblesim.workloads generators: arrivals, lengths, synthetic traces, stdlib-text token ids,
ServeGen reasoning workloads, trace statistics."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from shared_data import SHARED_TRACES, needs_shared

from bubblesim.core.cli import UsageError
from bubblesim.core.trace import TokenLists, TraceError, make_trace, read_trace, write_trace
from bubblesim.workloads.arrivals import arrival_times, gaps, weibull_shape
from bubblesim.workloads.lengths import parse_length, read_length_pairs
from bubblesim.workloads.servegen import servegen_trace
from bubblesim.workloads.stats import prefix_reuse, trace_stats
from bubblesim.workloads.synth import SynthSpec, synthesize
from bubblesim.workloads.textids import ngram_accepted, stdlib_sources


def rate_and_cv(t: np.ndarray) -> tuple[float, float]:
    g = np.diff(t)
    return 1.0 / g.mean(), g.std() / g.mean()


# ---- arrivals -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gamma", "weibull"])
@pytest.mark.parametrize("cv", [0.5, 1.0, 2.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_renewal_arrivals_hit_rate_and_cv(kind: str, cv: float, seed: int) -> None:
    t = arrival_times(np.random.default_rng(seed), kind, 8.0, cv, num_requests=40_000)
    rate, got_cv = rate_and_cv(t)
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()
    assert rate == pytest.approx(8.0, rel=0.06)
    assert got_cv == pytest.approx(cv, rel=0.08)


def test_poisson_fixed_and_burst() -> None:
    rate, cv = rate_and_cv(
        arrival_times(np.random.default_rng(0), "poisson", 3.0, num_requests=20_000)
    )
    assert rate == pytest.approx(3.0, rel=0.05) and cv == pytest.approx(1.0, rel=0.05)
    fixed = arrival_times(np.random.default_rng(0), "fixed", 4.0, num_requests=5)
    np.testing.assert_allclose(fixed, [0, 0.25, 0.5, 0.75, 1.0])
    burst = arrival_times(np.random.default_rng(0), "burst", 1.0, num_requests=7)
    assert (burst == 0).all() and len(burst) == 7


def test_duration_mode_stays_inside_the_span() -> None:
    t = arrival_times(np.random.default_rng(3), "gamma", 20.0, 4.0, duration_s=300.0)
    assert t.max() < 300.0 and len(t) == pytest.approx(6000, rel=0.25)


def test_weibull_shape_inverts_the_cv() -> None:
    assert weibull_shape(1.0) == pytest.approx(1.0, rel=1e-6)
    for cv in (0.3, 0.9, 3.0):
        k = weibull_shape(cv)
        back = math.sqrt(math.exp(math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k)) - 1)
        assert back == pytest.approx(cv, rel=1e-6)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(kind="poisson", rate=0.0), "--rate"),
        (dict(kind="gamma", rate=1.0, cv=0.0), "--cv"),
        (dict(kind="erlang", rate=1.0), "--arrival"),
    ],
)
def test_bad_arrival_options(kw: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        gaps(np.random.default_rng(0), kw["kind"], kw["rate"], kw.get("cv", 1.0), 3)


# ---- lengths --------------------------------------------------------------------------------
def test_length_specs() -> None:
    rng = np.random.default_rng(0)
    assert (parse_length("128").sample(rng, 5) == 128).all()
    u = parse_length("uniform:16:20").sample(rng, 2000)
    assert u.min() == 16 and u.max() == 20
    ln = parse_length("lognormal:500:0.8:4000").sample(rng, 20_000)
    assert np.median(ln) == pytest.approx(500, rel=0.05) and ln.max() <= 4000 and ln.min() >= 1
    for bad in ("0", "uniform:5:2", "gauss:3:4", "lognormal:x:1", ""):
        with pytest.raises(UsageError, match="--prompt-len"):
            parse_length(bad)


def test_length_pairs_from_csv_and_trace(tmp_path: Path) -> None:
    csv = tmp_path / "l.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens,pd_ratio\n10,20,0.5\n30,40,0.7\n")
    p, o = read_length_pairs(csv)
    assert p.tolist() == [10, 30] and o.tolist() == [20, 40]
    tr = write_trace(make_trace([0, 1], [5, 6], [7, 8]), tmp_path / "t.parquet")
    p, o = read_length_pairs(tr)
    assert p.tolist() == [5, 6] and o.tolist() == [7, 8]
    csv.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n0,40\n")
    with pytest.raises(TraceError, match=r"line 3 column 'num_prefill_tokens'"):
        read_length_pairs(csv)
    csv.write_text("prompt_len,output_len\n10,abc\n")
    with pytest.raises(TraceError, match=r"line 2 column 'output_len'.*got 'abc'"):
        read_length_pairs(csv)
    csv.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="no known length columns"):
        read_length_pairs(csv)


# ---- synthetic traces -----------------------------------------------------------------------
def spec(**kw) -> SynthSpec:
    base = dict(
        arrival="gamma",
        rate=5.0,
        cv=2.0,
        num_requests=200,
        prompt_len=parse_length("uniform:16:300"),
        output_len=parse_length("lognormal:80:1"),
        needs_history=0.3,
        seed=7,
    )
    base.update(kw)
    return SynthSpec(**base)  # type: ignore[arg-type]


def test_synth_is_deterministic_by_seed(tmp_path: Path) -> None:
    a = write_trace(synthesize(spec()), tmp_path / "a.parquet")
    b = write_trace(synthesize(spec()), tmp_path / "b.parquet")
    c = write_trace(synthesize(spec(seed=8)), tmp_path / "c.parquet")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_synth_streams_are_independent() -> None:
    """Changing the lengths leaves the arrivals of the same seed unchanged."""
    a = synthesize(spec())
    b = synthesize(spec(output_len=parse_length("7"), needs_history=0.0))
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    np.testing.assert_array_equal(a.prompt_len, b.prompt_len)
    assert (b.output_len == 7).all()


def test_synth_columns() -> None:
    t = synthesize(spec(num_requests=4000, accept_rate=0.6))
    assert t.history_mask().mean() == pytest.approx(0.3, abs=0.04)
    assert t.accept_rate is not None and (t.accept_rate == np.float32(0.6)).all()
    assert t.prompt_ids is None and "seed 7" in t.metadata["description"]


def test_synth_lengths_from_file_keeps_pairs(tmp_path: Path) -> None:
    src = write_trace(make_trace([0, 1, 2], [10, 20, 30], [1, 2, 3]), tmp_path / "src.parquet")
    t = synthesize(spec(prompt_len=None, output_len=None, lengths_from=str(src)))
    pairs = set(zip(t.prompt_len.tolist(), t.output_len.tolist()))
    assert pairs <= {(10, 1), (20, 2), (30, 3)} and len(pairs) == 3


def test_synth_refuses_bad_options() -> None:
    with pytest.raises(UsageError, match="--needs-history"):
        synthesize(spec(needs_history=1.5))
    with pytest.raises(UsageError, match="--lengths-from"):
        synthesize(spec(prompt_len=None))
    with pytest.raises(UsageError, match="--ngram-friendly needs --token-ids"):
        synthesize(spec(ngram_friendly=True))


# ---- token ids --------------------------------------------------------------------------------
def test_token_ids_are_stdlib_bytes_and_outputs_continue_prompts(tmp_path: Path) -> None:
    t = synthesize(
        spec(
            num_requests=6,
            token_ids=True,
            prompt_len=parse_length("uniform:20:60"),
            output_len=parse_length("uniform:5:30"),
        )
    )
    assert t.prompt_ids is not None and t.output_ids is not None
    assert (t.prompt_ids.lengths() == t.prompt_len).all()
    assert (t.output_ids.lengths() == t.output_len).all()
    assert t.prompt_ids.values.max() <= 255 and t.prompt_ids.values.min() >= 0
    root = Path(sysconfig.get_paths()["stdlib"])
    where = t.metadata["text_sources"].split("; ", 1)[1].split("; ", 1)[1].split()
    for i, w in enumerate(where):
        rel, off = w.rsplit("@", 1)
        data = (root / rel).read_bytes()
        start = int(off)
        want = np.frombuffer(data[start : start + t.prompt_len[i] + t.output_len[i]], np.uint8)
        got = np.concatenate([t.prompt_ids[i], t.output_ids[i]])
        np.testing.assert_array_equal(got, want)
    read_trace(write_trace(t, tmp_path / "ids.parquet"), model=None)


def test_stdlib_sources_exclude_third_party() -> None:
    files = stdlib_sources()
    assert len(files) > 100
    assert not any("site-packages" in p.parts for p in files)
    assert [str(p) for p in files] == sorted(
        (str(p) for p in files),
        key=lambda s: Path(s).relative_to(sysconfig.get_paths()["stdlib"]).as_posix(),
    )


def test_ngram_friendly_text_repeats_more() -> None:
    from bubblesim.workloads.stats import ngram_draft_fraction

    kw = dict(
        num_requests=6,
        arrival="burst",
        token_ids=True,
        prompt_len=parse_length("300"),
        output_len=parse_length("200"),
    )
    plain = ngram_draft_fraction(synthesize(spec(**kw)), 6)
    friendly = ngram_draft_fraction(synthesize(spec(ngram_friendly=True, **kw)), 6)
    assert friendly > plain


def test_ngram_accepted_by_hand() -> None:
    # prompt "a b c a b" then output "c a b c": the suffix "a b" recurs -> drafts "c a b"
    seq = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3])
    acc = ngram_accepted(seq, 5, k=3, min_n=2, max_n=4)
    assert acc.tolist() == [3]  # one step: 3 drafts accepted + 1 token = all 4 outputs
    none = ngram_accepted(np.array([1, 2, 3, 4, 5, 6]), 3)
    assert none.tolist() == [0, 0, 0]


def test_ngram_accepted_matches_core_proposer() -> None:
    ngram = pytest.importorskip("bubblesim.core.ngram")
    rng = np.random.default_rng(0)
    for _ in range(40):
        seq = rng.integers(0, 4, 60)
        prompt = int(rng.integers(2, 30))
        expect, pos = [], prompt
        while pos < len(seq):
            drafts = ngram.propose(seq[:pos].tolist(), 3, 2, 4)
            a = ngram.accepted_prefix(drafts, seq[pos:].tolist())
            expect.append(a)
            pos += a + 1
        assert ngram_accepted(seq, prompt).tolist() == expect


# ---- ServeGen -------------------------------------------------------------------------------
def servegen_fixture(folder: Path) -> Path:
    folder.mkdir()
    rows = ["0,2.0,1.0,Gamma,1.0,0.5", "600,0,0,,0,0", "1200,4.0,2.0,Weibull,0.54,0.1"]
    (folder / "chunk-0-trace.csv").write_text("\n".join(rows) + "\n")
    (folder / "chunk-3-trace.csv").write_text("0,1.0,1.0,Gamma,1.0,1.0\n")
    pmf = {
        "input_tokens": "{10: 0.5, 20: 0.5}",
        "output_tokens": "{1000: 0.25, 40000: 0.75}",
        "reason_ratio": "{0.5: 1.0}",
    }
    empty = {"input_tokens": "{}", "output_tokens": "{}", "reason_ratio": "{}"}
    data = {"0": pmf, "21600": empty, "43200": empty, "64800": empty}
    for c in (0, 3):
        (folder / f"chunk-{c}-dataset.json").write_text(json.dumps(data))
    return folder


def test_servegen_generator_on_a_fixture(tmp_path: Path) -> None:
    d = servegen_fixture(tmp_path / "sg")
    t = servegen_trace(d, seed=1, start_s=0, duration_s=1800, rate_scale=1.0, max_output=32_768)
    assert set(t.prompt_len.tolist()) <= {10, 20}
    assert set(t.output_len.tolist()) <= {1000, 32_768}  # 40000 capped
    assert t.history_mask().all()
    assert (np.diff(t.arrival_s) >= 0).all() and t.arrival_s.max() < 1800
    first = (t.arrival_s < 600).sum()  # clients 0 and 3: 3 req/s in window 0
    assert first == pytest.approx(1800, rel=0.15)
    assert ((t.arrival_s >= 600) & (t.arrival_s < 1200)).sum() == 0  # rate 0 window
    again = servegen_trace(d, seed=1, start_s=0, duration_s=1800)
    np.testing.assert_array_equal(t.arrival_s, again.arrival_s)
    with pytest.raises(UsageError, match="one day"):
        servegen_trace(d, seed=1, start_s=86_000, duration_s=600)


@needs_shared("servegen_deepseek_r1")
def test_servegen_real_tables() -> None:
    t = servegen_trace(
        SHARED_TRACES / "servegen_deepseek_r1",
        seed=0,
        start_s=43_200,
        duration_s=120,
        rate_scale=0.1,
    )
    assert 50 < len(t) < 600
    assert t.output_len.max() <= 32_768 and t.history_mask().all()


# ---- statistics -----------------------------------------------------------------------------
def test_prefix_reuse_counts_tokens_an_earlier_request_had() -> None:
    # arrival order: r1 (group 0, 100), r0 (group 0, 60), r2 (group 1, 50), r3 (group 1, 80)
    t = make_trace(
        [1.0, 0.0, 2.0, 3.0],
        [100, 100, 100, 100],
        [1, 1, 1, 1],
        prefix_group=np.array([0, 0, 1, 1], np.int32),
        prefix_keys=np.array([11, 22]),
        prefix_len=np.array([60, 100, 50, 80], np.int32),
    )
    # r0 reuses 60 of r1's 100; r3 reuses 50 of r2's 50 -> 110 of 400 prompt tokens
    assert prefix_reuse(t) == pytest.approx(110 / 400)
    assert prefix_reuse(make_trace([0.0], [5], [5])) == 0.0


def test_trace_stats() -> None:
    t = make_trace(
        np.arange(11) * 0.5,
        np.full(11, 10),
        np.arange(1, 12),
        needs_history=np.arange(11) < 2,
        prompt_ids=TokenLists.from_lists([[1] * 10] * 11),
        output_ids=TokenLists.from_lists([[1] * i for i in range(1, 12)]),
    )
    s = trace_stats(t)
    assert s["rows"] == 11 and s["span_s"] == 5.0 and s["req_per_s"] == pytest.approx(2.0)
    assert s["interarrival_cv"] == pytest.approx(0.0)
    assert s["output_len"]["p50"] == 6 and s["needs_history_fraction"] == pytest.approx(2 / 11)
    assert s["spec_columns"] == ["prompt_ids", "output_ids"]
    assert s["ngram_k3_draft_fraction"] > 0.5  # all-ones text: drafts always hit
