"""`RunRecorder`: what the step loop (sim or replay) records, cheaply, while it runs.

Per-call cost is a few array stores (`array.array` columns, 8 bytes a value, no Python float
objects kept), so a simulator can record millions of steps. Columns indexed by step are
pre-extended in chunks with NaN (times) or 0 (counts); append-only lists (sync waits, GC
pauses, inter-token gaps) grow by append. `freeze()` validates everything at once, vectorized,
and returns a `Recording` of numpy arrays.

Times are seconds on one clock whose 0 is the trace start. Invariants the caller keeps:
- one CPU thread: a CPU phase is recorded at most once per step (a second time raises);
- one GPU stream: each step has at most one GPU interval, and GPU intervals never overlap;
- a request's token emissions are recorded in time order (`tokens`).

Inter-token latency (ITL) is per token: an emission of n tokens (speculative decoding) after a
gap g since the request's previous emission counts n tokens of g / n each, and the extra tokens
of a request's first emission count as gaps of 0. So a request's ITLs sum to
last_token_s - first_token_s over output_tokens - 1 tokens, and their mean is its TPOT.
The first `itl_exact_limit` emissions are kept exactly (8 + 8 bytes each); past that they are
folded into a `LogHistogram` (relative error 0.1 %), deterministically.

With `spill_dir` (a folder the caller owns), the step columns and sync waits of steps more than
`spill_lag` steps old go to raw files there as the run goes (bubblesim.core.runfmt.spill), so a
run of millions of steps holds a few chunks of them in memory; recording into a step already
written out raises. `freeze` then maps the files: the same arrays, read-only.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Hashable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from bubblesim.core.phases import ALL_CPU_ACTIVITIES, CPU_PHASES, SYNC
from bubblesim.core.runfmt.recording import Recording, validate
from bubblesim.core.runfmt.sketch import LogHistogram
from bubblesim.core.runfmt.spill import StepSpill
from bubblesim.core.runfmt.stats import QUANTILES, weighted_quantiles
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape

_NAN = math.nan
_shape_values = attrgetter(*SHAPE_FIELDS)
# GC `phase` codes: index into this tuple ("" = not known)
GC_PHASE_NAMES: tuple[str, ...] = ("", *ALL_CPU_ACTIVITIES)
_GC_PHASE_CODE = {name: i for i, name in enumerate(GC_PHASE_NAMES)}
_NAN_BYTES = array("d", [_NAN]).tobytes()  # an unset time (what `_grow` fills in)
_VECTOR_TIMES = 64  # tokens_ranges over more emission times than this works in numpy


class RunRecorder:
    def __init__(
        self,
        itl_exact_limit: int = 1 << 20,
        chunk_steps: int = 1 << 16,
        spill_dir: str | Path | None = None,
        spill_lag: int = 4096,
    ) -> None:
        self.num_steps = 0
        self._base = 0  # the first step the in-memory step columns hold (the rest: spilled)
        self._cap = 0  # rows of the in-memory step columns, from _base
        self._spill = StepSpill(spill_dir) if spill_dir is not None else None
        self._lag = spill_lag  # steps kept in memory behind the newest (passes in flight)
        self._chunk = chunk_steps
        self._shape_buf: list[tuple[int, ...]] = []  # rows in SHAPE_FIELDS order
        self._shape_chunks: list[np.ndarray] = []
        self._phase: dict[str, tuple[array[float], array[float]]] = {
            p: (array("d"), array("d")) for p in CPU_PHASES
        }
        self._gpu_start: array[float] = array("d")
        self._gpu_end: array[float] = array("d")
        self._accepted: array[int] = array("q")
        self._sync_start: array[float] = array("d")
        self._sync_end: array[float] = array("d")
        self._sync_step: array[int] = array("q")
        self._gc_start: array[float] = array("d")
        self._gc_dur: array[float] = array("d")
        self._gc_gen: array[int] = array("q")
        self._gc_phase: array[int] = array("q")
        self._gc_step: array[int] = array("q")
        self._req_ids: list[Hashable] = []
        self._arrival: array[float] = array("d")
        self._first: array[float] = array("d")
        self._last: array[float] = array("d")
        self._finish: array[float] = array("d")
        self._out: array[int] = array("q")
        self._preempt: array[int] = array("q")
        self._req_acc: array[int] = array("q")
        self._itl_v: array[float] = array("d")
        self._itl_w: array[int] = array("q")
        self._itl_limit = itl_exact_limit
        self._itl_entries = 0  # emissions (one gap each) since the last fold, kept or bulk
        self._itl_hist: LogHistogram | None = None
        self._released: Recording | None = None  # freeze(release=True) gave this

    # ---- steps ----------------------------------------------------------------------------
    def add_step(self, shape: BatchShape) -> int:
        """Start recording a step with this batch composition; returns its index (0, 1, ...)."""
        i = self.num_steps
        if i - self._base == self._cap:
            self._grow()
        self._shape_buf.append(_shape_values(shape))
        if len(self._shape_buf) >= self._chunk:
            self._flush_shapes()
        self.num_steps = i + 1
        return i

    def phase(self, step: int, name: str, start_s: float, end_s: float) -> None:
        """A CPU phase (bubblesim.core.phases.CPU_PHASES, or `sync`) of `step` ran over
        [start_s, end_s]."""
        try:
            starts, ends = self._phase[name]
        except KeyError:
            if name == SYNC:
                return self.sync(step, start_s, end_s)
            raise ValueError(f"unknown CPU phase {name!r}; expected one of {CPU_PHASES}") from None
        k = step - self._base
        if not 0 <= k < self.num_steps - self._base:
            raise IndexError(self._absent(f"phase {name!r}", step))
        if starts[k] == starts[k]:  # not NaN: already set
            raise ValueError(f"phase {name!r} recorded twice in step {step}")
        starts[k] = start_s
        ends[k] = end_s

    def gpu(self, step: int, start_s: float, end_s: float) -> None:
        """The GPU work of `step` (forward, sampling, GPU drafting) ran over [start_s, end_s]."""
        k = step - self._base
        if not 0 <= k < self.num_steps - self._base:
            raise IndexError(self._absent("gpu", step))
        if self._gpu_start[k] == self._gpu_start[k]:
            raise ValueError(f"gpu interval recorded twice in step {step}")
        self._gpu_start[k] = start_s
        self._gpu_end[k] = end_s

    def sync(self, step: int, start_s: float, end_s: float) -> None:
        """The CPU thread blocked on the GPU over [start_s, end_s] (any number per step)."""
        if not 0 <= step < self.num_steps:
            raise IndexError(f"sync: step {step} was not added")
        self._sync_start.append(start_s)
        self._sync_end.append(end_s)
        self._sync_step.append(step)

    def accepted(self, step: int, num_tokens: int) -> None:
        """Add draft tokens accepted in `step` (may be called when its results arrive)."""
        k = step - self._base
        if not 0 <= k < self.num_steps - self._base:
            raise IndexError(self._absent("accepted", step))
        self._accepted[k] += num_tokens

    def gc_pause(
        self,
        start_s: float,
        duration_s: float,
        generation: int,
        phase: str = "",
        step: int | None = None,
    ) -> None:
        """A collector pause; `phase` is the activity it interrupted, `step` defaults to the
        latest added step (-1 before any)."""
        try:
            code = _GC_PHASE_CODE[phase]
        except KeyError:
            raise ValueError(
                f"gc_pause: unknown phase {phase!r}; expected one of {GC_PHASE_NAMES}"
            ) from None
        self._gc_start.append(start_s)
        self._gc_dur.append(duration_s)
        self._gc_gen.append(generation)
        self._gc_phase.append(code)
        self._gc_step.append(self.num_steps - 1 if step is None else step)

    # ---- bulk appends (a simulator fast-forwarding a run of alike steps) -------------------
    # Each is exactly the per-call methods above called once per element, in order.
    def add_steps(
        self,
        shapes: Sequence[Sequence[int]] | np.ndarray,
        phases: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    ) -> int:
        """`add_step` for each row of `shapes` (BatchShape fields in SHAPE_FIELDS order, ints;
        a (n, len(SHAPE_FIELDS)) integer array is taken as is), then
        `phase(step, name, starts[i], ends[i])` for each new step and each
        `phases[name] = (starts, ends)`; returns the index of the first step added."""
        first = self.num_steps
        n = len(shapes)
        width = len(SHAPE_FIELDS)
        rows: np.ndarray | None = None
        if isinstance(shapes, np.ndarray):
            if shapes.ndim != 2 or shapes.shape[1] != width or shapes.dtype.kind not in "iu":
                raise ValueError(f"add_steps: shapes must be an (n, {width}) integer array")
            rows = shapes.astype(np.int64, copy=False)  # kept (the caller's: read only)
        else:
            for row in shapes:
                if len(row) != width:
                    raise ValueError(
                        f"add_steps: a shape row has {len(row)} values, expected {width} "
                        f"({', '.join(SHAPE_FIELDS)})"
                    )
        for name, (starts_s, ends_s) in (phases or {}).items():
            if name not in self._phase:
                raise ValueError(f"unknown CPU phase {name!r}; expected one of {CPU_PHASES}")
            if not len(starts_s) == len(ends_s) == n:
                raise ValueError(f"add_steps: phase {name!r} needs {n} starts and ends")
        if self._cap < first + n - self._base:
            # grow by an eighth, not double as `_grow` does: a long run of bulk adds then
            # holds ~1.1x its steps in memory rather than up to 2x
            self._grow(max(self._chunk, self._cap // 8, first + n - self._base - self._cap))
        if rows is not None:
            self._flush_shapes()  # keeps rows in step order
            if n:
                self._shape_rows(rows)
        else:
            self._shape_buf.extend(map(tuple, shapes))
            if len(self._shape_buf) >= self._chunk:
                self._flush_shapes()
        self.num_steps = first + n
        cut = slice(first - self._base, first + n - self._base)
        for name, (starts_s, ends_s) in (phases or {}).items():
            starts, ends = self._phase[name]
            starts[cut] = _doubles(starts_s)  # new steps: nothing recorded there yet
            ends[cut] = _doubles(ends_s)
        return first

    def phases(
        self, first_step: int, name: str, starts_s: Sequence[float], ends_s: Sequence[float]
    ) -> None:
        """`phase(first_step + i, name, starts_s[i], ends_s[i])` for every i."""
        try:
            starts, ends = self._phase[name]
        except KeyError:
            raise ValueError(f"unknown CPU phase {name!r}; expected one of {CPU_PHASES}") from None
        cut = self._steps_slice(f"phases {name!r}", first_step, starts_s, ends_s)
        if not _unset(starts[cut]):
            raise ValueError(f"phase {name!r} recorded twice in steps {cut.start}..{cut.stop - 1}")
        starts[cut] = _doubles(starts_s)
        ends[cut] = _doubles(ends_s)

    def gpus(self, first_step: int, starts_s: Sequence[float], ends_s: Sequence[float]) -> None:
        """`gpu(first_step + i, starts_s[i], ends_s[i])` for every i."""
        cut = self._steps_slice("gpus", first_step, starts_s, ends_s)
        if not _unset(self._gpu_start[cut]):
            raise ValueError(f"gpu interval recorded twice in steps {cut.start}..{cut.stop - 1}")
        self._gpu_start[cut] = _doubles(starts_s)
        self._gpu_end[cut] = _doubles(ends_s)

    def syncs(
        self,
        steps: Sequence[int] | np.ndarray,
        starts_s: Sequence[float] | np.ndarray,
        ends_s: Sequence[float] | np.ndarray,
    ) -> None:
        """`sync(steps[i], starts_s[i], ends_s[i])` for every i, in order."""
        if not len(steps) == len(starts_s) == len(ends_s):
            raise ValueError("syncs: steps, starts_s and ends_s differ in length")
        if len(steps) >= _VECTOR_TIMES:
            many = np.asarray(steps, np.int64)  # checked and stored through numpy (an array's
            # buffer as it is)
            if not (many.min() >= 0 and many.max() < self.num_steps):
                raise IndexError("syncs: a step was not added")
            self._sync_step.frombytes(many.tobytes())
        else:
            if len(steps) and not (min(steps) >= 0 and max(steps) < self.num_steps):
                raise IndexError("syncs: a step was not added")
            _extend(self._sync_step, steps)
        _extend(self._sync_start, starts_s)
        _extend(self._sync_end, ends_s)

    def accepted_many(self, first_step: int, counts: Sequence[int]) -> None:
        """`accepted(first_step + i, counts[i])` for every i."""
        n = len(counts)
        if not (first_step >= self._base and first_step + n <= self.num_steps):
            raise IndexError(self._absent("accepted_many", first_step, n))
        cut = slice(first_step - self._base, first_step + n - self._base)
        self._accepted[cut] = array("q", [a + b for a, b in zip(self._accepted[cut], counts)])

    def tokens_many(
        self,
        reqs: Sequence[int] | np.ndarray,
        times_s: Sequence[float] | np.ndarray,
        ns: Sequence[int] | np.ndarray,
        accepted: Sequence[int] | np.ndarray,
    ) -> None:
        """`tokens(reqs[i], times_s[i], ns[i], accepted[i])` for every i, in order (each
        request's emissions in time order), vectorized: the same per-request columns and the
        same multiset of inter-token gaps (hence the same quantiles), appended per request."""
        m = len(reqs)
        if not m:
            return
        if not len(times_s) == len(ns) == len(accepted) == m:
            raise ValueError("tokens_many: reqs, times_s, ns and accepted differ in length")
        r = np.asarray(reqs, np.int64)
        order = np.argsort(r, kind="stable")  # by request, each in call order
        r = r[order]
        t = np.asarray(times_s, np.float64)[order]
        n = np.asarray(ns, np.int64)[order]
        acc = np.asarray(accepted, np.int64)[order]
        if n.min() < 1:
            raise ValueError(f"tokens_many: request row {int(r[n.argmin()])}: n must be >= 1")
        head = np.ones(m, dtype=bool)  # first emission of each request here
        head[1:] = r[1:] != r[:-1]
        starts = np.flatnonzero(head)
        ends = np.append(starts[1:], m) - 1
        rows = r[starts]
        out = np.frombuffer(self._out, np.int64)
        last = np.frombuffer(self._last, np.float64)
        count0 = out[rows]
        prev = np.empty(m)
        prev[1:] = t[:-1]
        prev[starts] = last[rows]  # NaN for a request without tokens yet
        has_prev = np.ones(m, dtype=bool)
        has_prev[starts] = count0 > 0
        gap = t[has_prev] - prev[has_prev]
        if gap.size and not gap.min() >= 0:
            bad = np.flatnonzero(has_prev)[np.argmin(gap)]
            raise ValueError(
                f"tokens: request row {int(r[bad])}: emission at {t[bad]} before the last"
            )
        fresh = starts[count0 == 0]  # a request's first emission: first_token, extra tokens 0
        first = np.frombuffer(self._first, np.float64)
        first[r[fresh]] = t[fresh]
        extra = fresh[n[fresh] > 1]
        last[rows] = t[ends]
        out[rows] = count0 + np.add.reduceat(n, starts)
        req_acc = np.frombuffer(self._req_acc, np.int64)
        req_acc[rows] += np.add.reduceat(acc, starts)
        del out, last, first, req_acc  # views into the columns: release before they grow
        vals = np.concatenate((gap / n[has_prev], np.zeros(extra.size)))
        wts = np.concatenate((n[has_prev], n[extra] - 1))
        self._itl_v.extend(array("d", vals.tobytes()))
        self._itl_w.extend(array("q", wts.astype(np.int64).tobytes()))
        self._itl_entries += int(vals.size)
        if self._itl_entries >= self._itl_limit:
            self._fold_itl()

    def tokens_each(self, reqs: Sequence[int], times_s: Sequence[float]) -> None:
        """Every request row of `reqs` emitted one token at each time of `times_s` (ascending),
        as `tokens(r, t)` for each t, for each r would record, in O(len(reqs) + len(times_s)):
        after a request's first emission here the gaps are the same for every request, so each
        is kept once with weight len(reqs) (the same ITL multiset, hence the same quantiles)."""
        n, m = len(times_s), len(reqs)
        if not n or not m:
            return
        t_first, t_last = times_s[0], times_s[-1]
        gaps = [b - a for a, b in zip(times_s[:-1], times_s[1:])]
        if gaps and min(gaps) < 0:
            raise ValueError("tokens_each: times_s must be ascending")
        last, out, first = self._last, self._out, self._first
        itl_v, itl_w = self._itl_v, self._itl_w
        entries = 0
        for r in reqs:
            count = out[r]
            if count:
                gap_s = t_first - last[r]
                if gap_s < 0:
                    raise ValueError(
                        f"tokens: request row {r}: emission at {t_first} before the last"
                    )
                itl_v.append(gap_s)
                itl_w.append(1)
                entries += 1
            else:
                first[r] = t_first
            last[r] = t_last
            out[r] = count + n
        if gaps:
            itl_v.extend(gaps)
            itl_w.extend(array("q", [m]) * len(gaps))
            entries += m * len(gaps)
        self._itl_entries += entries
        if self._itl_entries >= self._itl_limit:
            self._fold_itl()

    def tokens_ranges(
        self,
        reqs: Sequence[int],
        starts: Sequence[int],
        stops: Sequence[int],
        times_s: Sequence[float],
    ) -> None:
        """Request row reqs[j] emitted one token at each time of times_s[starts[j]:stops[j]]
        (times ascending), as the matching `tokens` calls in time order would record, in
        O(len(reqs) + len(times_s)): a gap between two consecutive times is kept once, weighted
        by the number of requests that emitted at both."""
        n = len(times_s)
        if not len(reqs) == len(starts) == len(stops):
            raise ValueError("tokens_ranges: reqs, starts and stops differ in length")
        vector = n > _VECTOR_TIMES  # the per-time work in numpy (same values, same order)
        gap_arr = np.diff(np.asarray(times_s, np.float64)) if vector else np.zeros(0)
        gaps = [] if vector else [b - a for a, b in zip(times_s[:-1], times_s[1:])]
        if (gap_arr.size and gap_arr.min() < 0) or (gaps and min(gaps) < 0):
            raise ValueError("tokens_ranges: times_s must be ascending")
        last, out, first = self._last, self._out, self._first
        itl_v, itl_w = self._itl_v, self._itl_w
        # diff[i] - diff[i - 1]: requests emitting at both i and i + 1
        diff: list[int] | np.ndarray = [0] * (n + 1)
        entries = 0
        heads = self._range_heads(reqs, starts, stops, times_s) if vector else None
        if heads is not None:  # many distinct requests: their part in numpy too
            diff, entries = heads
        else:
            for r, i0, i1 in zip(reqs, starts, stops):
                if i0 >= i1:
                    continue
                if i0 < 0 or i1 > n:
                    raise IndexError(
                        f"tokens_ranges: request row {r}: range {i0}..{i1} of {n} times"
                    )
                t0 = times_s[i0]
                count = out[r]
                if count:
                    gap_s = t0 - last[r]
                    if gap_s < 0:
                        raise ValueError(
                            f"tokens: request row {r}: emission at {t0} before the last"
                        )
                    itl_v.append(gap_s)
                    itl_w.append(1)
                    entries += 1
                else:
                    first[r] = t0
                last[r] = times_s[i1 - 1]
                out[r] = count + i1 - i0
                diff[i0] += 1
                diff[i1 - 1] -= 1
        if vector:  # both[i]: the requests emitting at both times i and i + 1
            both = np.cumsum(np.asarray(diff[: n - 1], np.int64))
            keep = both != 0
            itl_v.extend(array("d", gap_arr[keep].tobytes()))
            itl_w.extend(array("q", both[keep].tobytes()))
            entries += int(both.sum())
        else:
            w = 0
            for i, gap_s in enumerate(gaps):
                w += diff[i]
                if w:
                    itl_v.append(gap_s)
                    itl_w.append(w)
                    entries += w
        self._itl_entries += entries
        if self._itl_entries >= self._itl_limit:
            self._fold_itl()

    def _range_heads(
        self,
        reqs: Sequence[int],
        starts: Sequence[int],
        stops: Sequence[int],
        times_s: Sequence[float],
    ) -> tuple[np.ndarray, int] | None:
        """`tokens_ranges`' per-request part (each request's first emission there: its gap
        from its last one, or its first token; its last token and count) for many distinct
        requests, in numpy: the same values, ITL entries in the same order, the same first
        error. Returns (diff, ITL entries added); None (nothing done) for few requests or a
        request named twice (the loop's order then matters)."""
        r = np.asarray(reqs, np.int64)
        if r.size <= _VECTOR_TIMES or np.unique(r).size < r.size:
            return None
        n = len(times_s)
        i0, i1 = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        live = np.flatnonzero(i0 < i1)
        r, i0, i1 = r[live], i0[live], i1[live]
        t = np.asarray(times_s, np.float64)
        out = np.frombuffer(self._out, np.int64)
        last = np.frombuffer(self._last, np.float64)
        first = np.frombuffer(self._first, np.float64)
        outside = np.flatnonzero((i0 < 0) | (i1 > n))
        at = np.minimum(i0, n - 1)  # the first emission's time (any, for a range outside)
        count = out[r]
        has = count > 0
        t0 = t[at]
        gap = t0 - last[r]
        early = np.flatnonzero(has & (gap < 0))
        if outside.size or early.size:  # the first error in request order, as the loop's
            j = min(x[0] for x in (outside, early) if x.size)
            del out, last, first
            if outside.size and outside[0] == j:
                raise IndexError(
                    f"tokens_ranges: request row {r[j]}: range {i0[j]}..{i1[j]} of {n} times"
                )
            raise ValueError(f"tokens: request row {r[j]}: emission at {t0[j]} before the last")
        first[r[~has]] = t0[~has]
        last[r] = t[i1 - 1]
        out[r] = count + (i1 - i0)
        del out, last, first  # views into the columns: release before they grow
        gap = gap[has]
        self._itl_v.extend(array("d", gap.tobytes()))
        self._itl_w.extend(array("q", [1]) * gap.size)
        diff = np.bincount(i0, minlength=n + 1) - np.bincount(i1 - 1, minlength=n + 1)
        return diff, int(gap.size)

    def _steps_slice(
        self, what: str, first: int, starts_s: Sequence[float], ends_s: Sequence[float]
    ) -> slice:
        n = len(starts_s)
        if len(ends_s) != n:
            raise ValueError(f"{what}: {n} starts but {len(ends_s)} ends")
        if not (first >= self._base and first + n <= self.num_steps):
            raise IndexError(self._absent(what, first, n))
        return slice(first - self._base, first + n - self._base)

    def _absent(self, what: str, first: int, n: int = 1) -> str:
        """The error for steps [first, first + n) outside the in-memory columns."""
        steps = f"step {first}" if n == 1 else f"steps {first}..{first + n - 1}"
        if first < self._base and first >= 0:
            return f"{what}: {steps} already written to the spill folder (older than spill_lag)"
        return f"{what}: {steps} {'was not added' if n == 1 else 'were not all added'}"

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: Hashable, arrival_s: float) -> int:
        """A request arrived; returns its dense row (0, 1, ...) for the calls below. Adding
        requests in trace order makes the row the trace row
        (`bubblesim.core.request.Request.index`)."""
        self._req_ids.append(request_id)
        self._arrival.append(arrival_s)
        self._first.append(_NAN)
        self._last.append(_NAN)
        self._finish.append(_NAN)
        self._out.append(0)
        self._preempt.append(0)
        self._req_acc.append(0)
        return len(self._req_ids) - 1

    def add_requests(self, request_ids: Sequence[Hashable], arrivals_s: Sequence[float]) -> int:
        """`add_request` for each (id, arrival) in order; returns the first new row."""
        if len(request_ids) != len(arrivals_s):
            raise ValueError("add_requests: request_ids and arrivals_s differ in length")
        first, n = len(self._req_ids), len(request_ids)
        self._req_ids.extend(request_ids)
        self._arrival.extend(_doubles(arrivals_s))
        nans, zeros = array("d", [_NAN]) * n, array("q", [0]) * n
        for col in (self._first, self._last, self._finish):
            col.extend(nans)
        for icol in (self._out, self._preempt, self._req_acc):
            icol.extend(zeros)
        return first

    def tokens(self, req: int, t_s: float, n: int = 1, accepted_draft: int = 0) -> None:
        """Request row `req` emitted `n` tokens at `t_s`, `accepted_draft` of them drafts."""
        if n < 1:
            raise ValueError(f"tokens: request row {req}: n must be >= 1, got {n}")
        count = self._out[req]
        if count:
            gap_s = t_s - self._last[req]
            if gap_s < 0:
                raise ValueError(f"tokens: request row {req}: emission at {t_s} before the last")
            self._itl_v.append(gap_s / n)
            self._itl_w.append(n)
            self._itl_entries += 1
        else:
            self._first[req] = t_s
            if n > 1:
                self._itl_v.append(0.0)
                self._itl_w.append(n - 1)
                self._itl_entries += 1
        self._last[req] = t_s
        self._out[req] = count + n
        if accepted_draft:
            self._req_acc[req] += accepted_draft
        if self._itl_entries >= self._itl_limit:
            self._fold_itl()

    def preempt(self, req: int) -> None:
        self._preempt[req] += 1

    def finish(self, req: int, t_s: float) -> None:
        if self._finish[req] == self._finish[req]:
            raise ValueError(f"finish: request row {req} finished twice")
        self._finish[req] = t_s

    @property
    def num_requests(self) -> int:
        return len(self._req_ids)

    # ---- read-only views (a caller watching the run, or merging recorders) ----------------
    # Zero-copy numpy views of the recorder's own columns: they see later `tokens`/`finish`
    # stores, but while one is alive its column cannot grow (array.array raises BufferError),
    # so take request views once every request was added, and ITL views once recording ended.
    @property
    def arrival_s(self) -> np.ndarray:
        """Read-only view: each request row's arrival time, seconds."""
        return self._view(self._arrival, np.float64)

    @property
    def first_token_s(self) -> np.ndarray:
        """Read-only view: each request row's first token time, seconds (NaN = none yet)."""
        return self._view(self._first, np.float64)

    @property
    def last_token_s(self) -> np.ndarray:
        """Read-only view: each request row's latest token time, seconds (NaN = none yet)."""
        return self._view(self._last, np.float64)

    @property
    def finish_s(self) -> np.ndarray:
        """Read-only view: each request row's finish time, seconds (NaN = not finished)."""
        return self._view(self._finish, np.float64)

    @property
    def output_tokens(self) -> np.ndarray:
        """Read-only view: each request row's output tokens so far (int64 count)."""
        return self._view(self._out, np.int64)

    @property
    def itl_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """Read-only views (values in seconds float64, weights in tokens int64) of the exact
        inter-token gaps not yet folded into `itl_histogram`: each value counts weight times."""
        return self._view(self._itl_v, np.float64), self._view(self._itl_w, np.int64)

    @property
    def itl_histogram(self) -> LogHistogram | None:
        """The inter-token gaps (seconds) folded so far, None while all are exact; the
        recorder's own (don't add to it)."""
        if self._released is not None:
            raise RuntimeError(_RELEASED)
        return self._itl_hist

    def _view(self, col: array[float] | array[int], dtype: type) -> np.ndarray:
        if self._released is not None:
            raise RuntimeError(_RELEASED)
        v: np.ndarray = np.frombuffer(col, dtype)
        v.flags.writeable = False
        return v

    # ---- freezing -------------------------------------------------------------------------
    def freeze(self, release: bool = False) -> Recording:
        """Numpy arrays of everything recorded, validated (one clear error on bad data).
        `release`: the recorder's columns become the Recording's (no copy: a run folder is then
        written with one copy of the steps in memory, not two); it records nothing more, and
        `freeze()` returns this same Recording from then on. A spilling recorder always
        releases: its step columns and sync waits are read-only maps of the spill files."""
        if self._released is not None:
            return self._released
        n = self.num_steps
        self._flush_shapes()
        release = release or self._spill is not None
        if self._spill is not None:
            steps = self._spilled_steps(n)
        else:
            steps = {
                "shape": _columns(self._shape_chunks, n, len(SHAPE_FIELDS)),
                "phase_start": _stack([self._phase[p][0] for p in CPU_PHASES], n),
                "phase_end": _stack([self._phase[p][1] for p in CPU_PHASES], n),
                "gpu_start": _head(self._gpu_start, np.float64, n, release),
                "gpu_end": _head(self._gpu_end, np.float64, n, release),
                "accepted": _head(self._accepted, np.int64, n, release),
                "sync_start": _head(self._sync_start, np.float64, None, release),
                "sync_end": _head(self._sync_end, np.float64, None, release),
                "sync_step": _head(self._sync_step, np.int64, None, release),
            }
        rec = Recording(
            **steps,
            gc_start=np.array(self._gc_start, np.float64),
            gc_dur=np.array(self._gc_dur, np.float64),
            gc_gen=np.array(self._gc_gen, np.int64),
            gc_phase=np.array(GC_PHASE_NAMES, dtype=object)[np.array(self._gc_phase, np.int64)],
            gc_step=np.array(self._gc_step, np.int64),
            request_id=self._req_ids if release else list(self._req_ids),
            arrival=_head(self._arrival, np.float64, None, release),
            first_token=_head(self._first, np.float64, None, release),
            last_token=_head(self._last, np.float64, None, release),
            finish=_head(self._finish, np.float64, None, release),
            output_tokens=_head(self._out, np.int64, None, release),
            preemptions=_head(self._preempt, np.int64, None, release),
            req_accepted=_head(self._req_acc, np.int64, None, release),
            itl_quantiles=self._itl_quantiles(),
            itl_exact=self._itl_hist is None,
        )
        validate(rec, trusted=release)  # released: nothing else writes its arrays
        if release:
            self._release(rec)
        return rec

    def _spilled_steps(self, n: int) -> dict[str, np.ndarray]:
        """Every step column and sync wait written out, mapped back (read-only)."""
        sp = self._spill
        assert sp is not None
        self._spill_steps(n)
        sp.close()
        f64 = np.float64
        out = {
            "shape": sp.block("shape", [f"shape.{f}" for f in SHAPE_FIELDS], np.int64, n),
            "phase_start": sp.block("phase_start", [f"start.{p}" for p in CPU_PHASES], f64, n),
            "phase_end": sp.block("phase_end", [f"end.{p}" for p in CPU_PHASES], f64, n),
            "gpu_start": sp.column("gpu_start", f64, n),
            "gpu_end": sp.column("gpu_end", f64, n),
            "accepted": sp.column("accepted", np.int64, n),
        }
        m = sp.rows("sync_step")
        out.update(
            sync_start=sp.column("sync_start", f64, m),
            sync_end=sp.column("sync_end", f64, m),
            sync_step=sp.column("sync_step", np.int64, m),
        )
        return out

    def _release(self, rec: Recording) -> None:
        self._released = rec
        gone = _Released(len(self._req_ids))
        for name in _COLUMNS:
            setattr(self, name, gone)

    def _itl_quantiles(self) -> dict[str, float | None]:
        qs = list(QUANTILES.values())
        if self._itl_hist is None:
            vals = np.array(self._itl_v, np.float64)
            x = weighted_quantiles(vals, np.array(self._itl_w, np.int64), qs)
        else:
            self._fold_itl()
            x = self._itl_hist.quantiles(qs)
        return {k: (None if math.isnan(v) else float(v)) for k, v in zip(QUANTILES, x)}

    def _fold_itl(self) -> None:
        if self._itl_hist is None:
            self._itl_hist = LogHistogram()
        self._itl_hist.add(np.array(self._itl_v, np.float64), np.array(self._itl_w, np.int64))
        del self._itl_v[:]
        del self._itl_w[:]
        self._itl_entries = 0

    def _flush_shapes(self) -> None:
        if self._shape_buf:
            rows = np.array(self._shape_buf, dtype=np.int64)
            self._shape_rows(rows.reshape(len(self._shape_buf), len(SHAPE_FIELDS)))
            self._shape_buf = []

    def _shape_rows(self, rows: np.ndarray) -> None:
        """The next shape rows, in step order: kept, or written out when spilling (a shape is
        final once its step is added)."""
        if self._spill is None:
            self._shape_chunks.append(rows)
            return
        for j, f in enumerate(SHAPE_FIELDS):
            self._spill.append(f"shape.{f}", rows[:, j])

    def _spill_steps(self, upto: int) -> None:
        """Write out the step columns of steps [_base, upto) and every sync wait so far, and
        drop them from memory."""
        assert self._spill is not None
        k = upto - self._base
        if k > 0:
            for p, (starts, ends) in self._phase.items():
                self._spill.append(f"start.{p}", np.frombuffer(starts, np.float64, count=k))
                self._spill.append(f"end.{p}", np.frombuffer(ends, np.float64, count=k))
                del starts[:k]
                del ends[:k]
            for name, col, dtype in (
                ("gpu_start", self._gpu_start, np.float64),
                ("gpu_end", self._gpu_end, np.float64),
                ("accepted", self._accepted, np.int64),
            ):
                self._spill.append(name, np.frombuffer(col, dtype, count=k))
                del col[:k]
            self._base, self._cap = upto, self._cap - k
        for name, col, dtype in (
            ("sync_start", self._sync_start, np.float64),
            ("sync_end", self._sync_end, np.float64),
            ("sync_step", self._sync_step, np.int64),
        ):
            self._spill.append(name, np.frombuffer(col, dtype))
            del col[:]

    def _grow(self, more: int | None = None) -> None:
        if self._spill is not None:
            self._spill_steps(max(self.num_steps - self._lag, self._base))
            more = more or self._chunk  # no doubling: the columns hold a window of steps
        if more is None:
            more = max(self._chunk, self._cap)
        nans = array("d", [_NAN]) * more
        for starts, ends in self._phase.values():
            starts.extend(nans)
            ends.extend(nans)
        self._gpu_start.extend(nans)
        self._gpu_end.extend(nans)
        self._accepted.extend(array("q", [0]) * more)
        self._cap += more


def _extend(col: array[Any], values: Sequence[Any] | np.ndarray) -> None:
    """`col.extend(values)`; many values that are not an array through numpy (array converts
    each value through PyArg_Parse, ~10x numpy's conversion)."""
    if isinstance(values, array) or len(values) < _VECTOR_TIMES:
        col.extend(values)
    else:
        col.frombytes(np.asarray(values, np.dtype(col.typecode)).tobytes())


def _doubles(values: Sequence[float]) -> array[float]:
    if isinstance(values, array) and values.typecode == "d":
        return values
    return array("d", values)


def _unset(times: array[float]) -> bool:
    """No value set (all NaN, as `phase`/`gpu` test one: x != x)."""
    return times.tobytes() == _NAN_BYTES * len(times) or all(x != x for x in times)


def _head(
    col: array[float] | array[int], dtype: type, n: int | None, share: bool = False
) -> np.ndarray:
    """The first n values (all with None) of a column (a step column's capacity runs past
    them): a copy, or with `share` a view of the column itself (which then cannot grow)."""
    v: np.ndarray = np.frombuffer(col, dtype, count=-1 if n is None else n)
    return v if share else v.copy()


def _stack(cols: list[array[float]], n: int) -> np.ndarray:
    """(n, len(cols)) in column-major order: each column contiguous, as the run folder's
    tables take them (no copy there)."""
    out = np.empty((n, len(cols)), np.float64, order="F")
    for j, c in enumerate(cols):
        out[:, j] = np.frombuffer(c, np.float64, count=n)
    return out


def _columns(chunks: list[np.ndarray], n: int, width: int) -> np.ndarray:
    """The (rows, width) int64 chunks stacked into (n, width), column-major as `_stack`."""
    out = np.empty((n, width), np.int64, order="F")
    at = 0
    for c in chunks:
        out[at : at + len(c)] = c
        at += len(c)
    assert at == n, f"{at} shape rows for {n} steps"
    return out


# every column `freeze(release=True)` drops
_COLUMNS: tuple[str, ...] = (
    "_shape_buf", "_shape_chunks", "_phase", "_gpu_start", "_gpu_end", "_accepted",
    "_sync_start", "_sync_end", "_sync_step", "_gc_start", "_gc_dur", "_gc_gen", "_gc_phase",
    "_gc_step", "_req_ids", "_arrival", "_first", "_last", "_finish", "_out", "_preempt",
    "_req_acc", "_itl_v", "_itl_w",
)  # fmt: skip


class _Released:
    """Stands in for a column of a released recorder: any use is one clear error (its length,
    the number of requests, still reads)."""

    def __init__(self, num_requests: int) -> None:
        self.num_requests = num_requests

    def __len__(self) -> int:
        return self.num_requests

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(_RELEASED)

    def __getitem__(self, key: object) -> object:
        raise RuntimeError(_RELEASED)

    def __setitem__(self, key: object, value: object) -> None:
        raise RuntimeError(_RELEASED)

    def __iter__(self) -> object:
        raise RuntimeError(_RELEASED)


_RELEASED = "this RunRecorder was frozen with release=True: it records nothing more"
