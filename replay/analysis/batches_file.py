"""Decode batches to time instead of the sweep's grid (`replay shapes --batches FILE`).

A JSON file:

    {"format": "replay.batches", "version": 1,
     "batches": [{"label": "run-a:1234:mixed", "contexts": [1821, 977, ...]}, ...]}

Each batch is a decode step of len(contexts) rows, row i reading contexts[i] keys (its new token
included), in that order (the order the kernel's grid takes them). Labels are unique, and each
is the `label` of its row in the sweep file. How such batches are made from a measured run:
reports/fidelity/isolate.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replay.analysis.shapes_grid import Batch, decode_row

FORMAT, VERSION = "replay.batches", 1
MIN_CONTEXT = 2  # a decode row reads its prompt's token and its own at least


class BatchesError(ValueError):
    """A batches file that cannot be read; the message names the file and the problem."""


def batches_doc(batches: Sequence[tuple[str, Sequence[int]]]) -> dict[str, Any]:
    """The file's content for (label, contexts) pairs."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "batches": [{"label": label, "contexts": [int(c) for c in ctx]} for label, ctx in batches],
    }


def read_batches(
    path: str | Path, max_rows: int | None = None, max_context: int | None = None
) -> list[Batch]:
    """The file's batches, checked (module docstring): `max_rows` bounds a batch's rows (the
    engine's max_num_seqs), `max_context` a row's keys (its max_model_len)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BatchesError(f"{p}: not a readable JSON batches file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BatchesError(f"{p}: not a batches file (expected format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise BatchesError(f"{p}: batches file version {doc.get('version')!r}, expected {VERSION}")
    items = doc.get("batches")
    if not isinstance(items, list) or not items:
        raise BatchesError(f"{p}: 'batches' must be a non-empty list")
    out: list[Batch] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        label = item.get("label") if isinstance(item, dict) else None
        ctx = item.get("contexts") if isinstance(item, dict) else None
        where = f"{p}: batch {i}"
        if not isinstance(label, str) or not label:
            raise BatchesError(f"{where}: 'label' must be a non-empty string")
        if label in seen:
            raise BatchesError(f"{where}: label {label!r} appears twice")
        seen.add(label)
        if not isinstance(ctx, list) or not ctx:
            raise BatchesError(f"{where} ({label}): 'contexts' must be a non-empty list")
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in ctx):
            raise BatchesError(f"{where} ({label}): 'contexts' must hold integers")
        if min(ctx) < MIN_CONTEXT:
            raise BatchesError(f"{where} ({label}): a context below {MIN_CONTEXT} keys")
        if max_context is not None and max(ctx) > max_context:
            raise BatchesError(
                f"{where} ({label}): a context of {max(ctx)} keys, more than max_model_len = "
                f"{max_context}"
            )
        if max_rows is not None and len(ctx) > max_rows:
            raise BatchesError(
                f"{where} ({label}): {len(ctx)} rows, more than max_num_seqs = {max_rows}"
            )
        out.append(Batch(label, tuple(decode_row(c) for c in ctx)))
    return out
