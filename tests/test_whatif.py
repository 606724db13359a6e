"""`python -m sim whatif`: output shape, determinism across pool sizes, the seed 3 and seed 4
directions, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.cli import run_main
from bubblesim.core.config import Config
from bubblesim.core.trace import TokenLists, make_trace, write_trace
from sim.whatif import BASELINE, METRICS, VARIANT_NAMES, main, make_plan, select_variants

TINY = ["--set", "model=tiny", "--set", "num_kv_blocks=4096"]


def repetitive_ids(rng: np.random.Generator, n: int, motif_len: int = 40) -> np.ndarray:
    """Text that repeats a random motif with a few mutations: n-gram drafts are often right."""
    motif = rng.integers(0, 256, motif_len)
    ids = np.resize(motif, n)
    flip = rng.random(n) < 0.05
    ids[flip] = rng.integers(0, 256, int(flip.sum()))
    return ids


def id_trace(path: Path, n: int, prompt_len: int, output_len: int, history: bool) -> Path:
    rng = np.random.default_rng(7)
    prompts, outputs = [], []
    for _ in range(n):
        ids = repetitive_ids(rng, prompt_len + output_len)
        prompts.append(ids[:prompt_len])
        outputs.append(ids[prompt_len:])
    trace = make_trace(
        np.linspace(0.0, 0.01, n),
        [prompt_len] * n,
        [output_len] * n,
        prompt_ids=TokenLists.from_lists(prompts),
        output_ids=TokenLists.from_lists(outputs),
        needs_history=np.full(n, history),
    )
    return write_trace(trace, path)


def whatif(argv: list[str]) -> int:
    return run_main(main, argv)


def load(out: Path) -> dict:
    return json.loads((out / "whatif.json").read_text())


def test_every_variant_has_every_metric_and_pool_size_changes_nothing(tmp_path):
    trace = id_trace(tmp_path / "t.parquet", 6, 48, 24, history=True)
    common = [str(trace), *TINY, "--set", "spec.method=ngram-gpu", "-q"]
    assert whatif([*common, "-o", str(tmp_path / "j1"), "--jobs", "1"]) == 0
    assert whatif([*common, "-o", str(tmp_path / "j2"), "--jobs", "2", "--keep-runs"]) == 0

    j1, j2 = (tmp_path / "j1" / "whatif.json"), (tmp_path / "j2" / "whatif.json")
    assert j1.read_bytes() == j2.read_bytes()
    result = load(tmp_path / "j1")
    assert list(result) == list(VARIANT_NAMES)
    for variant, metrics in result.items():
        assert list(metrics) == list(METRICS), variant
        for m, pair in metrics.items():
            assert set(pair) == {"baseline", "variant"}, (variant, m)
    for m in ("output_tok_per_s", "tpot_s.p99", "ttft_s.p50", "bubble_fraction"):
        assert result["gc.model"][m]["baseline"] > 0, m
    # a variant equal to the baseline is the baseline's own run
    same = result["spec.method=ngram-gpu"]
    assert all(p["baseline"] == p["variant"] for p in same.values())
    info = json.loads((tmp_path / "j1" / "whatif-info.json").read_text())
    assert info["variants"]["spec.method=ngram-gpu"]["run"] == BASELINE
    assert info["variants"]["reverse_placeholder_scan"]["overrides"] == {
        "reverse_placeholder_scan": False
    }
    runs = tmp_path / "j2" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == sorted([BASELINE, *VARIANT_NAMES])
    assert (runs / "gc.model" / "summary.json").is_file()
    assert not list((tmp_path / "j1").glob(".whatif-runs-*"))  # temp run folders removed


@pytest.mark.slow
def test_forward_placeholder_scan_lowers_throughput_on_long_histories(tmp_path):
    """Seed 3: with long needs_history outputs the O(output length) scan joins the CPU step,
    which a tiny model's GPU pass cannot hide."""
    n, out_len = 32, 6000
    trace = make_trace(np.zeros(n), [64] * n, [out_len] * n, needs_history=np.ones(n, bool))
    path = write_trace(trace, tmp_path / "long.parquet")
    out = tmp_path / "w"
    argv = [str(path), *TINY, "--set", "num_kv_blocks=16384", "--variants"]
    assert whatif([*argv, "reverse_placeholder_scan", "-o", str(out), "-q"]) == 0
    m = load(out)["reverse_placeholder_scan"]
    tok = m["output_tok_per_s"]
    assert tok["variant"] < 0.97 * tok["baseline"]  # -6.7 % with the default costs
    assert m["tpot_s.mean"]["variant"] > m["tpot_s.mean"]["baseline"]


def test_gpu_ngram_beats_cpu_ngram_at_low_concurrency(tmp_path):
    """Seed 4: the CPU proposer forces a synchronous loop (GPU idle during CPU work)."""
    trace = id_trace(tmp_path / "ids.parquet", 2, 256, 256, history=False)
    out = tmp_path / "w"
    argv = [str(trace), "--set", "model=llama3.2-1b", "--set", "spec.method=ngram-gpu"]
    assert whatif([*argv, "--variants", "ngram_proposer", "-o", str(out), "-q"]) == 0
    m = load(out)["ngram_proposer"]
    assert m["accepted_draft_tokens"]["baseline"] > 0  # the text is n-gram friendly
    tok = m["output_tok_per_s"]
    assert tok["variant"] < tok["baseline"]
    assert m["tpot_s.mean"]["variant"] > m["tpot_s.mean"]["baseline"]


def test_bad_variant_is_one_clear_line_and_writes_nothing(tmp_path, capsys):
    trace = id_trace(tmp_path / "t.parquet", 2, 16, 8, history=False)
    out = tmp_path / "w"
    with pytest.raises(SystemExit) as e:
        whatif([str(trace), *TINY, "--variants", "gc_freeze,bogus", "-o", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'bogus'" in err and "gc_freeze" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--set", "spec.k=0"], "spec.k"),
        (["--set", "gpu=nope"], "gpu"),
        (["--jobs", "0"], "--jobs"),
    ],
)
def test_bad_config_or_jobs_exit_2_before_any_run(tmp_path, capsys, argv, needle):
    trace = id_trace(tmp_path / "t.parquet", 2, 16, 8, history=False)
    out = tmp_path / "w"
    with pytest.raises(SystemExit) as e:
        whatif([str(trace), *TINY, *argv, "-o", str(out)])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_a_refused_run_leaves_no_output(tmp_path, capsys):
    trace = id_trace(tmp_path / "t.parquet", 2, 64, 64, history=False)
    out = tmp_path / "w"
    with pytest.raises(SystemExit) as e:  # 2 blocks of 16 cannot hold 128 tokens
        whatif([str(trace), "--set", "model=tiny", "--set", "num_kv_blocks=2", "-o", str(out)])
    assert e.value.code == 2
    assert "KV blocks" in capsys.readouterr().err
    assert not out.exists()


def test_plan_reuses_runs_and_names_inert_switches():
    base = Config(model="tiny")  # spec.method=none, batches_in_flight=2
    plan = make_plan(base, select_variants(None), history=False)
    assert plan.uses["batches_in_flight=2"] == BASELINE
    assert plan.uses["ngram_proposer"] == BASELINE  # nothing to swap without spec decoding
    assert plan.uses["spec.method=ngram-cpu"] == "spec.method=ngram-cpu"
    assert "speculative" in (plan.notes["preallocated_backup_tokens"] or "")
    assert "needs_history" in (plan.notes["reverse_placeholder_scan"] or "")
    assert plan.notes["batches_in_flight=3"] is None
    assert [v.name for v in select_variants("gc.model, preallocated_backup_tokens")] == [
        "preallocated_backup_tokens",
        "gc.model",
    ]


def test_sampling_variants_set_every_sampling_key_and_know_when_they_cannot_act() -> None:
    """sampling=<mode> sets temperature, top_k and top_p together (the sweep's parameters), and
    is inert where the baseline samples so already; the penalties stay the baseline's."""
    from bubblesim.core.config import load_config
    from sim.whatif import VARIANTS

    by_name = {v.name: v for v in VARIANTS}
    greedy = load_config(None, [])
    top_p = load_config(None, ["sampling.temperature=1", "sampling.top_p=0.9"])
    over = by_name["sampling=top_p"].overrides(greedy)
    assert over == {"sampling.temperature": 1.0, "sampling.top_k": 0, "sampling.top_p": 0.9}
    assert by_name["sampling=greedy"].overrides(top_p)["sampling.temperature"] == 0.0
    assert by_name["sampling=greedy"].inert(greedy, False) is not None
    assert by_name["sampling=top_p"].inert(top_p, False) is not None
    assert by_name["sampling=top_p"].inert(greedy, False) is None
    assert by_name["sampling=top_k"].inert(top_p, True) is None
