"""Import of Mooncake traces (JSON lines: timestamp ms, input_length, output_length, hash_ids).

`hash_ids` are remapped hashes of a request's 512-token prompt blocks; equal ids mean reusable
KV-cache blocks, and block i's id depends on blocks 0..i (a prefix hash), so two requests share
blocks exactly along a common leading run of ids.

Contract 1 gives a request one shared prefix (prefix_id, prefix_len), so the block tree is
flattened: a request's prefix is the LONGEST leading run of its hash_ids that is also a leading
run of at least one other request (earlier or later); prefix_id = a stable int64 hash of that
run (blake2b of the ids), prefix_len = min(512 * run length, prompt_len). Requests with no
shared leading block have no prefix.

The approximation: sharing between requests whose longest runs differ is lost. If A and B
share 12 blocks and C shares only the first 6 with them, A and B get one prefix_id (12 blocks)
and C another (6 blocks, shared with whichever other request also has exactly that run), so a
cache keyed by prefix_id sees no reuse between C and A. Blocks past the first non-shared block
(rare, since ids are prefix hashes) are not represented either.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np

from bubblesim.core.trace import Trace, TraceError, encode_prefixes, make_trace

BLOCK_TOKENS = 512
MOONCAKE_LICENSE = (
    "Apache-2.0; Mooncake FAST'25 traces (github.com/kvcache-ai/Mooncake), Qin et al., "
    "'Mooncake: Trading More Storage for Less Computation', FAST 2025"
)


def _run_keys(hash_ids: list[int]) -> list[bytes]:
    """key[j] identifies the leading run hash_ids[0..j]: a chained blake2b, O(len) per request."""
    keys, prev = [], b""
    for h in hash_ids:
        prev = hashlib.blake2b(
            prev + int(h).to_bytes(8, "little", signed=True), digest_size=8
        ).digest()
        keys.append(prev)
    return keys


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(
                    f"mooncake JSONL '{path}' line {line_no}: not JSON ({e.msg})"
                ) from None
            for key, kind in (
                ("timestamp", (int, float)),
                ("input_length", int),
                ("output_length", int),
                ("hash_ids", list),
            ):
                v = row.get(key) if isinstance(row, dict) else None
                if v is None or isinstance(v, bool) or not isinstance(v, kind):
                    raise TraceError(
                        f"mooncake JSONL '{path}' line {line_no} column '{key}': missing or not "
                        f"{'a list' if kind is list else 'a number'}"
                    )
            if not all(isinstance(h, int) and not isinstance(h, bool) for h in row["hash_ids"]):
                raise TraceError(
                    f"mooncake JSONL '{path}' line {line_no} column 'hash_ids': must be integers"
                )
            row["_line"] = line_no
            rows.append(row)
    if not rows:
        raise TraceError(f"mooncake JSONL '{path}': has no rows")
    return rows


def shared_prefixes(
    hash_ids: list[list[int]], prompt_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(has_prefix bool, prefix_id int64, prefix_len int32) per request (see module doc)."""
    keys = [_run_keys(h) for h in hash_ids]
    count = Counter(k for ks in keys for k in ks)  # each run key once per request (chained)
    n = len(hash_ids)
    has = np.zeros(n, dtype=bool)
    pid = np.zeros(n, dtype=np.int64)
    plen = np.zeros(n, dtype=np.int32)
    for i, ks in enumerate(keys):
        depth = 0
        while depth < len(ks) and count[ks[depth]] >= 2:
            depth += 1
        if depth:
            has[i] = True
            pid[i] = int.from_bytes(ks[depth - 1], "little", signed=True)
            plen[i] = min(BLOCK_TOKENS * depth, int(prompt_len[i]))
    return has, pid, plen


def import_mooncake(path: str | Path, max_total_len: int | None = None) -> tuple[Trace, int]:
    """(trace, rows dropped): arrival = (timestamp - earliest timestamp) / 1000; requests
    with input_length + output_length > max_total_len are dropped (counted) when it is given."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"mooncake JSONL '{p}': no such file")
    rows = _read_jsonl(p)
    for col in ("input_length", "output_length"):
        bad = next((r for r in rows if r[col] < 1), None)
        if bad is not None:
            raise TraceError(
                f"mooncake JSONL '{p}' line {bad['_line']} column '{col}': must be >= 1, "
                f"got {bad[col]}"
            )
    total = np.array([r["input_length"] + r["output_length"] for r in rows])
    keep = np.ones(len(rows), bool) if max_total_len is None else total <= max_total_len
    kept = [r for r, k in zip(rows, keep.tolist()) if k]
    if not kept:
        raise TraceError(f"mooncake JSONL '{p}': no request within {max_total_len} tokens")
    stamp_ms = np.array([float(r["timestamp"]) for r in kept])
    prompt = np.array([r["input_length"] for r in kept], dtype=np.int64)
    output = np.array([r["output_length"] for r in kept], dtype=np.int64)
    # prefixes are derived from the kept requests only: a dropped request shares nothing
    has, pid, plen = shared_prefixes([r["hash_ids"] for r in kept], prompt)
    group, keys = encode_prefixes(pid, has)
    dropped = len(rows) - len(kept)
    note = f"; {dropped} requests over {max_total_len} tokens dropped" if dropped else ""
    trace = make_trace(
        (stamp_ms - stamp_ms.min()) / 1000.0,
        prompt,
        output,
        prefix_group=group,
        prefix_keys=keys,
        prefix_len=plen,
        metadata={
            "source": f"Mooncake trace ({p.name})",
            "license": MOONCAKE_LICENSE,
            "description": f"{len(kept)} requests, arrivals as recorded; prefix = longest "
            f"leading run of 512-token hash blocks shared with another request{note}",
        },
    )
    return trace, dropped
