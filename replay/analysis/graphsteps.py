"""Decode graph padding as steps on the decode table's x axis (num_tokens).

A decode batch of b requests replays the graph of the smallest bucket B >= b (engine.graphs):
its GEMMs, logits and sampling run B rows, its attention only the b real ones. Between two
buckets a < B a step takes W(B) + A(b, context): it steps up from a to a + 1, then rises with
the attention alone. The sweep samples the buckets and the midpoints between them
(replay.analysis.shapes_grid.batch_axis); the rows say which bucket each replayed (`bucket`). A
table node at a + 1 (no row lies there) with the table's curvature penalty cut between a and a + 1
lets the plain bilinear table hold that step: batches a + 1..B interpolate between the node at
a + 1 (continued linearly back from the segment's rows) and B, all at B's weight cost, where
interpolating from a would charge them part of a's. Nothing changes in the sim: the table stays
bilinear in (num_tokens, kv_per_token) and reads the fields it read before. numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Cols = Mapping[str, np.ndarray]
Segment = tuple[float, float]  # (first x of a padded segment, its bucket's x), num_tokens


def padded_segments(
    cols: Cols, rows: np.ndarray, bucket: np.ndarray, buckets: Sequence[int]
) -> list[Segment]:
    """Per bucket B that rows among `rows` replayed padded (bucket > num_reqs): (a + 1, B) in
    query rows (x (k + 1) with k drafts per request), a the bucket before B in `buckets` (the
    engine's sizes; 0 before the first)."""
    pad = rows & (bucket > cols["num_reqs"])
    out: set[Segment] = set()
    known = sorted(set(int(b) for b in buckets) | {int(b) for b in np.unique(bucket[pad])})
    for b in np.unique(bucket[pad]):
        prev = [v for v in known if v < b]
        first = (prev[-1] if prev else 0) + 1
        mine = pad & (bucket == b)
        for q in np.unique(cols["num_tokens"][mine] / cols["num_reqs"][mine]):
            out.add((float(first * q), float(b * q)))
    return sorted(out)


def with_steps(xs: Sequence[float], segments: Sequence[Segment]) -> tuple[list[float], list[float]]:
    """`xs` (the data's nodes) with each segment's first x added where the segment holds 2 or
    more nodes, its bucket's x included (the rows pin its line); and those first x values: the
    breaks, where the table's x curvature is not penalised."""
    nodes = set(xs)
    breaks = []
    for first, end in segments:
        inside = [x for x in xs if first <= x <= end]
        if end in nodes and len(inside) >= 2 and first > min(xs):
            breaks.append(first)
    return sorted(nodes | set(breaks)), sorted(breaks)
