"""A decode graph issued to an idle GPU runs shorter than one queued behind the previous step
(measured on an H100: the saving grows with the idle gap, up to about half the pass). Two laws
(`gpu_pass.idle_start`): one ratio (`scale`), or a saving linear in the gap beyond
`shrink_after_ms`, capped at a fraction of the pass. The step loop and the fast-forwards apply
them identically; the defaults change nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import load_config
from sim.cost import ProfileError, load_cost_model
from sim.stream import IdleStart, gpu_pass
from tests.ffcheck import assert_same_records, records_without_and_with_fast_forward
from tests.helpers import mark_measured
from tests.test_sim import trace_file


def test_gpu_pass_scales_only_graphs_that_start_on_an_idle_gpu() -> None:
    ratio = IdleStart(min_s=1e-4, scale=0.5)
    # idle for 1 s before the graph is issued: scaled
    assert gpu_pass(0.0, 2.0, 1.0, 1.0, True, ratio) == (2.0, 2.5)
    # queued behind the previous pass: full time
    assert gpu_pass(0.0, 2.0, 3.0, 1.0, True, ratio) == (3.0, 4.0)
    # idle for less than the threshold: full time
    assert gpu_pass(0.0, 2.0, 2.0 - 5e-5, 1.0, True, ratio) == (2.0, 3.0)
    # eager passes are not graphs: unchanged
    assert gpu_pass(0.0, 2.0, 1.0, 1.0, False, ratio) == (1.0, 2.0)
    # no law: unchanged
    assert gpu_pass(0.0, 2.0, 1.0, 1.0, True) == (2.0, 3.0)


def test_shrink_law_grows_with_the_gap_up_to_its_cap() -> None:
    law = IdleStart(min_s=5e-5, per_s=0.8, after_s=2.5e-4, max_fraction=0.5)
    pass_s = 1.5e-3
    assert law.shorten(pass_s, 2.0e-4) == pass_s  # before `after`: nothing saved
    assert law.shorten(pass_s, 7.5e-4) == pytest.approx(pass_s - 0.8 * 5e-4)
    assert law.shorten(pass_s, 5e-3) == pytest.approx(0.5 * pass_s)  # capped
    # through the stream: idle 0.75 ms before a 1.5 ms graph
    start, end = gpu_pass(0.0, 1.0, 1.0 - 7.5e-4, pass_s, True, law)
    assert (start, end) == (1.0, pytest.approx(1.0 + pass_s - 4e-4))
    # the ratio is ignored once the law is on
    both = IdleStart(min_s=5e-5, scale=0.1, per_s=0.8, after_s=2.5e-4, max_fraction=0.5)
    assert both.shorten(pass_s, 7.5e-4) == law.shorten(pass_s, 7.5e-4)


def _profile(tmp: Path, scale: float, **law: float) -> Path:
    p = tmp / f"idle{scale}{'-law' if law else ''}.json"
    p.write_text(json.dumps({"version": 1, "gpu_pass": {"idle_start": {"scale": scale, **law}}}))
    return p


LAW = {"shrink_per_ms": 0.8, "shrink_after_ms": 0.25, "shrink_max_fraction": 0.5}


@pytest.mark.parametrize("law", [{}, LAW], ids=["ratio", "law"])
@pytest.mark.parametrize("depth", [1, 2])
def test_fast_forward_applies_the_idle_scale_like_the_step_loop(
    tmp_path: Path, depth: int, law: dict[str, float]
) -> None:
    n = 24
    trace = trace_file(
        tmp_path, "t", np.linspace(0, 2.0, n), 200, np.full(n, 120)
    )  # a CPU-bound small model: depth 1 idles the GPU between steps
    sets = [
        "model=llama3.2-1b", "gpu=h100", f"batches_in_flight={depth}",
        f"profile={_profile(tmp_path, 0.6, **law)}",
    ]  # fmt: skip
    off, on = records_without_and_with_fast_forward(sets, trace)
    assert_same_records(off, on, f"depth {depth}")
    if depth == 1:  # synchronous: every decode graph starts on an idle GPU
        base, _ = records_without_and_with_fast_forward(sets[:-1], trace)
        busy = np.nansum(off.gpu_end - off.gpu_start)
        # the ratio saves 40 % of every pass; the law only past 0.25 ms of idle (this run's
        # host gaps are ~0.3 ms): something, less
        assert busy < (0.999 if law else 0.9) * np.nansum(base.gpu_end - base.gpu_start)


def test_idle_scale_is_validated(tmp_path: Path) -> None:
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={_profile(tmp_path, 1.5)}"])
    with pytest.raises(ProfileError, match=r"gpu_pass\.idle_start\.scale"):
        load_cost_model(cfg)
    cfg = load_config(None, ["model=llama3.2-1b"])
    assert not load_cost_model(cfg).idle_start.acts
    bad = _profile(tmp_path, 1.0, shrink_per_ms=0.5, shrink_max_fraction=1.0)
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={bad}"])
    with pytest.raises(ProfileError, match=r"gpu_pass\.idle_start\.shrink_max_fraction"):
        load_cost_model(cfg)


def test_calibrate_recovers_the_shrink_law(tmp_path: Path) -> None:
    """A depth-1 run made with a known law (as a measured run: its summary says replay) gives
    the law back from the decode model it was made with, and beats one ratio."""
    import sim.run as simrun
    from bubblesim.core.runfmt import load_run
    from replay.analysis.idle_start import fit_idle_start

    n = 60
    # a burst whose outputs end one by one: the batch, and with it the host time (the GPU's
    # idle gap), runs from ~40 rows down to 1
    trace = trace_file(tmp_path, "t", np.zeros(n), 200, np.linspace(10, 400, n).astype(int))
    decode = {"intercept": 1.2, "kv_read_tokens": 2e-5}
    law = {"scale": 1.0, "shrink_per_ms": 0.3, "shrink_after_ms": 0.1, "shrink_max_fraction": 0.8}
    # a host whose schedule phase grows with the batch: idle gaps from ~0.1 to ~2 ms
    sched = {"intercept": 0.05, "num_reqs": 0.05}
    made = {"version": 1, "gpu_pass": {"decode": decode, "idle_start": law},
            "cpu_phases": {"schedule": sched}}  # fmt: skip
    (tmp_path / "p.json").write_text(json.dumps(made))
    cfg = load_config(None, ["model=llama3.2-1b", "batches_in_flight=1",
                             f"profile={tmp_path / 'p.json'}"])  # fmt: skip
    simrun.simulate(cfg, trace, tmp_path / "run")
    mark_measured(tmp_path / "run")
    fit_with = {"version": 1, "gpu_pass": {"decode": decode}}
    table, report = fit_idle_start([load_run(tmp_path / "run")], fit_with)
    assert table is not None and report["steps"] >= 30
    assert report["idle_ms_p90"] > 2 * report["idle_ms_p10"]
    assert report["abs_err_ms_law"] < 0.02 < report["abs_err_ms_ratio"]
    # the gaps this run saw pin the saving there (not each parameter alone): compare savings
    for idle_ms in (report["idle_ms_p10"], report["idle_ms_p90"]):
        got = IdleStart.from_table(table).shorten(1.2e-3, idle_ms / 1e3)
        want = IdleStart.from_table({**law, "min_idle_ms": 0.05}).shorten(1.2e-3, idle_ms / 1e3)
        assert got == pytest.approx(want, abs=3e-5)


def test_verify_graphs_take_their_own_law() -> None:
    """Speculative decoding's verify graphs take the `verify_` law, none when it was not
    fitted; the ratio law covers both only while no shrink law is fitted."""
    base = {"scale": 0.6, "min_idle_ms": 0.05}
    decode = {"shrink_per_ms": 0.8, "shrink_after_ms": 0.25, "shrink_max_fraction": 0.5}
    verify = {
        "verify_shrink_per_ms": 0.9, "verify_shrink_after_ms": 0.3,
        "verify_shrink_max_fraction": 0.3,
    }  # fmt: skip
    pass_s, idle_s = 1.5e-3, 1e-3
    ratio_only = IdleStart.from_table(base, verify=True)
    assert ratio_only.shorten(pass_s, idle_s) == pytest.approx(0.6 * pass_s)
    no_verify_law = IdleStart.from_table({**base, **decode}, verify=True)
    assert not no_verify_law.acts
    both = {**base, **decode, **verify}
    v = IdleStart.from_table(both, verify=True)
    assert v.shorten(pass_s, 0.5e-3) == pytest.approx(pass_s - 0.9 * 0.2e-3)
    assert v.shorten(pass_s, idle_s) == pytest.approx(0.7 * pass_s)  # capped at 0.3
    assert IdleStart.from_table(both).shorten(pass_s, idle_s) == pytest.approx(pass_s - 0.6e-3)
