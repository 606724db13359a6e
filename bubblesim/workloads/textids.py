"""Real token sequences for speculative decoding: byte-level tokens of text that ships with
Python itself (the standard library's .py sources).

Token id = byte value (0..255), so the ids fit every model, the tiny preset (vocab 512)
included, and the engine can decode them forced: an n-gram (prompt lookup) proposer then finds
exactly the repeats the real text has. A request's prompt is `prompt_len` consecutive bytes of
one source file and its output the `output_len` bytes that follow, so the output continues the
prompt's text. Which file and where are drawn from the caller's numpy Generator (seeded).

The standard library differs between Python versions, so the same seed picks other text under
another Python: the bundled traces carry the version and each request's file@offset in their
metadata, and the ids themselves are stored in the trace.
"""

from __future__ import annotations

import platform
import sysconfig
from functools import cache
from pathlib import Path

import numpy as np

from bubblesim.core.cli import UsageError
from bubblesim.core.trace import TokenLists

SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


@cache
def stdlib_sources() -> tuple[Path, ...]:
    """The standard library's .py files, sorted by path (third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not any(part in SKIP_DIRS for part in p.relative_to(root).parts) and p.is_file()
    ]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


@cache
def _bytes(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


def _sizes() -> np.ndarray:
    return np.array([p.stat().st_size for p in stdlib_sources()], dtype=np.int64)


def ngram_accepted(
    tokens: np.ndarray, prompt_len: int, k: int = 3, min_n: int = 2, max_n: int = 4
) -> np.ndarray:
    """Accepted draft tokens per decode step of a prompt-lookup proposer on `tokens` (prompt
    followed by the forced output): each step drafts up to k tokens following the most recent
    earlier occurrence of the longest matching suffix n-gram (max_n..min_n), accepts the
    drafts that equal the real next tokens, and emits those plus one token."""
    seq = tokens.tolist()
    last: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its latest occurrence

    def index_upto(end: int, start: int) -> None:
        for e in range(start, end):
            for n in range(min_n, max_n + 1):
                if e - n + 1 >= 0:
                    last[tuple(seq[e - n + 1 : e + 1])] = e

    index_upto(prompt_len - 1, 0)  # every n-gram ending before the last context token
    steps = []
    pos = prompt_len  # tokens known so far; seq[pos] is the next one to produce
    indexed = prompt_len - 1
    while pos < len(seq):
        draft: list[int] = []
        for n in range(max_n, min_n - 1, -1):
            if pos - n < 0:
                continue
            end = last.get(tuple(seq[pos - n : pos]))
            if end is not None:
                draft = seq[end + 1 : min(end + 1 + k, pos)]
                break
        accepted = 0
        while (
            accepted < len(draft)
            and pos + accepted < len(seq)
            and (draft[accepted] == seq[pos + accepted])
        ):
            accepted += 1
        steps.append(accepted)
        pos += accepted + 1
        index_upto(min(pos - 1, len(seq)), indexed)  # n-grams ending before the new last token
        indexed = min(pos - 1, len(seq))
    return np.array(steps, dtype=np.int64)


def _score(tokens: np.ndarray, prompt_len: int) -> float:
    """Fraction of output tokens that came from accepted k=3 drafts."""
    acc = ngram_accepted(tokens, prompt_len)
    return float(acc.sum()) / max(1, len(tokens) - prompt_len)


def text_token_ids(
    rng: np.random.Generator,
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    ngram_friendly: bool = False,
    candidates: int = 16,
) -> tuple[TokenLists, TokenLists, str]:
    """(prompt_ids, output_ids, sources) for each request; `sources` names each request's
    file@offset. With `ngram_friendly`, each request takes the most repetitive of `candidates`
    random windows (highest prompt-lookup acceptance at k=3)."""
    files = stdlib_sources()
    if not files:
        raise UsageError("--token-ids: no standard-library .py sources found on this Python")
    sizes = _sizes()
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts, outputs, where = [], [], []
    for p_len, o_len in zip(prompt_len.tolist(), output_len.tolist()):
        need = p_len + o_len
        fit = np.flatnonzero(sizes >= need)
        if not len(fit):
            raise UsageError(
                f"--token-ids: prompt_len + output_len = {need} bytes, longer than any "
                f"standard-library source (max {sizes.max()})"
            )
        best: tuple[float, int, int] | None = None
        for _ in range(candidates if ngram_friendly else 1):
            f = int(fit[rng.integers(len(fit))])
            off = int(rng.integers(0, sizes[f] - need + 1))
            score = _score(_bytes(files[f])[off : off + need], p_len) if ngram_friendly else 0
            if best is None or score > best[0]:
                best = (score, f, off)
        assert best is not None
        _, f, off = best
        window = _bytes(files[f])[off : off + need].astype(np.int32)
        prompts.append(window[:p_len])
        outputs.append(window[p_len:])
        where.append(f"{files[f].relative_to(root).as_posix()}@{off}")
    header = f"python {platform.python_version()} stdlib .py bytes; request: file@offset; "
    return TokenLists.from_lists(prompts), TokenLists.from_lists(outputs), header + " ".join(where)
