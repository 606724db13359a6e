"""The penalties' GPU cost from a shape sweep's history rows (profile `gpu_pass.history`).

A decode step with any row whose sampling needs the output history replays the decode graph's
penalties variant (engine.graphs, engine.sampler.sample_graph): the penalties run on every row
of the bucket, vocab-wide, whatever the history's length (the counts are a dense [slot, vocab]
table). So the extra time is all or nothing per step and grows with the graph's rows:
    extra_ms = ms + ms_per_row x rows      (rows: the graph bucket; eager: num_reqs)
Each sweep row with history (`history_rows` > 0; replay.analysis.shapes_grid's decode(history) and
decode(history mix)) is paired with the sweep's row of the same shape without history (the
decode family's cell); extra_ms is their difference, fitted by least squares weighted by
1 / the pair's plain ms (relative error, as the decode table). The fitted values are clipped at
0 (a penalty never speeds a step up).

Speculative verify steps (a verify-width sweep's pairs, drafts > 0) are another path: the
penalties run on the rows that need them only, at each of their 1 + k sampled positions, so
    extra_ms = verify_ms + verify_ms_per_row x history rows
is fitted on those pairs alone. (Pooled with the decode pairs, as before 2026-11-27, they
doubled the decode term of llama3.2-1b's H100 profile: 0.101 ms + 9.18 us a row against 0.033 +
5.19 from its decode pairs; fidelity README section C.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.analysis.shapes_file import SweepRows

MIN_PAIRS = 3  # fewer pairs (or one row count only): no fit
PAIR_FIELDS = (  # what must match between a history row and its plain pair
    "num_reqs",
    "num_prefill_reqs",
    "decode_tokens",
    "draft_tokens",
    "kv_read_tokens",
    "attn_pairs",
    "max_kv_tokens",
)


def history_pairs(sweep: SweepRows) -> tuple[np.ndarray, np.ndarray]:
    """(history row, plain row) index pairs: decode rows with history and the decode row of the
    same shape (PAIR_FIELDS, graph, bucket) without; history rows without a pair are left out."""
    hist = sweep.history()
    key_cols = [sweep.cols[f] for f in PAIR_FIELDS]
    key_cols += [sweep.graph.astype(np.float64)]
    if sweep.bucket is not None:
        key_cols.append(sweep.bucket.astype(np.float64))

    def key(i: int) -> tuple[float, ...]:
        return tuple(float(c[i]) for c in key_cols)

    plain: dict[tuple[float, ...], int] = {}
    for i in np.flatnonzero(sweep.decode & ~hist):
        plain.setdefault(key(int(i)), int(i))
    h, p = [], []
    for i in np.flatnonzero(sweep.decode & hist):
        j = plain.get(key(int(i)))
        if j is not None:
            h.append(int(i))
            p.append(j)
    return np.array(h, np.int64), np.array(p, np.int64)


def padded_rows(sweep: SweepRows, idx: np.ndarray) -> np.ndarray:
    """The rows the penalties run on: the graph bucket (eager rows: num_reqs)."""
    n = sweep.cols["num_reqs"][idx]
    if sweep.bucket is None:
        return n
    b = sweep.bucket[idx].astype(np.float64)
    return np.where(b > 0, b, n)


def fit_history(sweep: SweepRows) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """(`gpu_pass.history` or None, a report): the fit of the module docstring, on the decode
    pairs (no drafts) and, apart, on the verify pairs (`verify_ms`, `verify_ms_per_row`)."""
    h, p = history_pairs(sweep)
    report: dict[str, Any] = {"history_rows": int(sweep.history().sum()), "pairs": int(len(h))}
    verify = sweep.cols["draft_tokens"][h] > 0
    model, dec = _fit_decode(sweep, h[~verify], p[~verify])
    report.update(dec)
    vmodel, report["verify"] = _fit_verify(sweep, h[verify], p[verify])
    if model is None and vmodel is None:
        report["why"] = dec["why"]
        return None, report
    out = model or {"ms": 0.0, "ms_per_row": 0.0}
    return {**out, **(vmodel or {})}, report


def _line(rows: np.ndarray, extra: np.ndarray, plain_ms: np.ndarray) -> tuple[float, float]:
    """extra = a + b x rows, least squares weighted by 1 / plain ms, clipped at 0."""
    w = 1.0 / plain_ms
    a = np.stack([np.ones_like(rows, dtype=np.float64), rows], axis=1) * w[:, None]
    coef, *_ = np.linalg.lstsq(a, extra * w, rcond=None)
    fixed_ms, per_row_ms = (max(0.0, float(x)) for x in coef)
    return fixed_ms, per_row_ms


def _fit_decode(
    sweep: SweepRows, h: np.ndarray, p: np.ndarray
) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """Decode steps: all or nothing per step, per padded graph row."""
    rows = padded_rows(sweep, h).astype(np.float64)
    if len(h) < MIN_PAIRS or len(np.unique(rows)) < 2:
        n = len(np.unique(rows))
        why = f"{len(h)} history rows with a plain pair over {n} sizes (decode steps)"
        return None, {"decode_pairs": int(len(h)), "why": why}
    plain_ms, hist_ms = sweep.gpu_ms[p], sweep.gpu_ms[h]
    extra = hist_ms - plain_ms
    fixed_ms, per_row_ms = _line(rows, extra, plain_ms)
    pred = fixed_ms + per_row_ms * rows
    ratio = hist_ms / plain_ms
    err = (plain_ms + pred) / hist_ms - 1  # the step's relative error with the term
    assert sweep.history_rows is not None  # history() found rows
    all_rows = sweep.history_rows[h] == sweep.cols["num_reqs"][h]
    return {"ms": fixed_ms, "ms_per_row": per_row_ms}, {
        "decode_pairs": int(len(h)),
        "ms": fixed_ms,
        "ms_per_row": per_row_ms,
        "rows": sorted(int(r) for r in np.unique(rows)),
        "ratio_p10": float(np.percentile(ratio, 10)),
        "ratio_p50": float(np.median(ratio)),
        "ratio_p90": float(np.percentile(ratio, 90)),
        "err_abs_p50": float(np.median(np.abs(err))),
        "err_abs_max": float(np.max(np.abs(err))),
        # some rows with history (mix): the engine's cost is all or nothing, so these fit
        # the same line; a large error here would say it is per history row after all
        "mix_err_p50": float(np.median(err[~all_rows])) if (~all_rows).any() else None,
        # per context: the extra ms per row should not depend on it (dense counts)
        "extra_us_per_row_by_context": _by_context(sweep, h, extra / rows),
    }


def _fit_verify(
    sweep: SweepRows, h: np.ndarray, p: np.ndarray
) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """Verify steps (drafts): the penalties run on the rows that need them, at every sampled
    position (1 + drafts a row), so the extra grows with the history rows, not the graph's
    (the report's `extra_ms_by_history_rows`: pairs of one graph with some of its rows
    needing the history)."""
    if len(h) < MIN_PAIRS:
        return None, {"pairs": int(len(h))}
    assert sweep.history_rows is not None  # history() found rows
    rows = sweep.history_rows[h].astype(np.float64)
    if len(np.unique(rows)) < 2:
        return None, {"pairs": int(len(h))}
    plain_ms, hist_ms = sweep.gpu_ms[p], sweep.gpu_ms[h]
    extra = hist_ms - plain_ms
    fixed_ms, per_row_ms = _line(rows, extra, plain_ms)
    err = (plain_ms + fixed_ms + per_row_ms * rows) / hist_ms - 1
    return {"verify_ms": fixed_ms, "verify_ms_per_row": per_row_ms}, {
        "pairs": int(len(h)),
        "ms": fixed_ms,
        "ms_per_row": per_row_ms,
        "err_abs_p50": float(np.median(np.abs(err))),
        "err_abs_max": float(np.max(np.abs(err))),
        "extra_ms_by_history_rows": _by_history_rows(sweep, h, extra),
    }


def _by_history_rows(sweep: SweepRows, h: np.ndarray, extra: np.ndarray) -> dict[str, Any]:
    """Per graph (bucket, longest context) with pairs at two or more history-row counts: the
    extra ms at each count (all or nothing per step would give one value)."""
    assert sweep.history_rows is not None
    bucket = padded_rows(sweep, h)
    ctx = sweep.cols["max_kv_tokens"][h]
    hist = sweep.history_rows[h]
    out: dict[str, Any] = {}
    for b, c in sorted({(int(x), int(y)) for x, y in zip(bucket, ctx)}):
        sel = (bucket == b) & (ctx == c)
        if len(np.unique(hist[sel])) > 1:
            counts = np.unique(hist[sel])
            out[f"{b} rows, {c} tokens"] = {
                str(int(k)): float(np.median(extra[sel & (hist == k)])) for k in counts
            }
    return out


def _by_context(sweep: SweepRows, idx: np.ndarray, per_row_ms: np.ndarray) -> dict[str, float]:
    """Median extra microseconds per row of the pairs, per longest context (max_kv_tokens)."""
    ctx = sweep.cols["max_kv_tokens"][idx]
    return {str(int(c)): float(np.median(per_row_ms[ctx == c]) * 1e3) for c in np.unique(ctx)}


def describe(report: dict[str, Any]) -> str:
    """One note line for calibrate."""
    if "ms" not in report and "ms" not in report.get("verify", {}):
        return f"gpu_pass.history: not fitted ({report.get('why', 'no history rows')})"
    parts = []
    if "ms" in report:
        mix = report.get("mix_err_p50")
        tail = f"; mixed-history rows' median error {mix:+.1%}" if mix is not None else ""
        parts.append(
            f"{report['ms']:.4f} ms + {report['ms_per_row'] * 1e3:.3f} us x graph rows on "
            f"decode steps with history, from {report['decode_pairs']} sweep pairs "
            f"(history/plain p10 {report['ratio_p10']:.3f}, p50 {report['ratio_p50']:.3f}, p90 "
            f"{report['ratio_p90']:.3f}; |error| p50 {report['err_abs_p50']:.1%}, max "
            f"{report['err_abs_max']:.1%}{tail})"
        )
    else:
        parts.append(f"decode not fitted ({report.get('why', '')})")
    v = report.get("verify", {})
    if "ms" in v:
        parts.append(
            f"verify steps {v['ms']:.4f} ms + {v['ms_per_row'] * 1e3:.3f} us x history rows, "
            f"from {v['pairs']} pairs (|error| p50 {v['err_abs_p50']:.1%}, max "
            f"{v['err_abs_max']:.1%})"
        )
    return "gpu_pass.history: " + "; ".join(parts)
