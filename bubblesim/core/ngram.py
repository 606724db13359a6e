"""Prompt-lookup (n-gram) drafting over a token sequence: pure Python, shared by the engine's
CPU proposer and the simulator's exact acceptance model.

Rule: for n from max_n down to min_n, find the most recent earlier occurrence of the last n
tokens; propose (up to) the k tokens that followed it. No match: no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Draft tokens for the sequence `tokens` (context = everything known so far)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        first = suffix[0]
        # scan back from the most recent possible start (excluding the suffix itself)
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start : start + n]) == suffix:
                follow = tokens[start + n : start + n + k]
                return list(follow)
    return []


def accepted_prefix(drafts: Sequence[int], actual: Sequence[int]) -> int:
    """Drafts accepted by greedy verification: the length of the common prefix."""
    n = 0
    for d, a in zip(drafts, actual):
        if d != a:
            break
        n += 1
    return n
