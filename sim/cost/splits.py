"""`program_keys`: the keys the longest program of this engine's decode attention kernel walks.

An engine-specific derived term (docs/cost-model.md, "Decode: the larger of the KV stream and the
longest program"). engine/kernels/decode_attention.py gives each (sequence, kv head) one program
or a few splits of whole key tiles (`decode_num_splits`, the kernel's `min_tiles`):
- a batch whose (sequence, kv head) programs fill the GPU (num_reqs x kv heads >=
  TARGET_PROGRAMS_PER_SM x SMs) splits only sequences longer than LONG_SPLIT_KEYS, into runs of at
  least LONG_SPLIT_KEYS keys, at most MAX_LONG_SPLITS of them;
- a smaller batch splits every sequence into the next power of two of ceil(fill / programs)
  (at most MAX_SPLITS) runs, with 32-key tiles from 16 splits on.
The longest program belongs to the longest sequence (`max_kv_tokens`): its keys per program are
what this returns. The constants mirror the engine's (tests/test_decode_max_model.py checks them
against `decode_num_splits`); the SM counts are the presets' datasheet values. The CUDA-graph
bucket padding of the batch size changes no split count (its powers of two absorb it).
"""

from __future__ import annotations

from collections.abc import Callable

TARGET_PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
LONG_SPLIT_KEYS = 4096
MAX_LONG_SPLITS = 8
TILE_KEYS = 64  # BLOCK_N; 32 when a small batch splits 16 or more ways
SMALL_TILE_KEYS = 32
NUM_SMS: dict[str, int] = {"h100": 132, "h200": 132, "a100": 108, "l40s": 142}

ProgramKeysFn = Callable[[int, int], int]  # (num_reqs, max_kv_tokens) -> keys
TailKeysFn = Callable[[int, int, int], int]  # (num_reqs, kv_read_tokens, max_kv_tokens) -> keys
TAIL_CAP_KEYS = LONG_SPLIT_KEYS  # beyond this the longest program is the straggler branch's


def num_sms(gpu: str) -> int | None:
    """SMs of a GPU preset, or of a device name holding one ('NVIDIA H200'); None if unknown."""
    low = gpu.lower()
    return next((n for name, n in NUM_SMS.items() if name in low), None)


def _pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def program_keys_fn(num_kv_heads: int, sms: int) -> ProgramKeysFn:
    """`(num_reqs, max_kv_tokens) -> keys of the longest program` for a model and a GPU."""
    fill = TARGET_PROGRAMS_PER_SM * sms
    long_tiles = LONG_SPLIT_KEYS // TILE_KEYS
    # num_reqs -> (key tile, power-of-two splits; 0: only long sequences split): what the
    # batch size decides, kept (the simulator asks at every decode step, batch sizes repeat)
    by_batch: dict[int, tuple[int, int]] = {}

    def split_of(num_reqs: int) -> tuple[int, int]:
        programs = num_reqs * num_kv_heads
        if programs >= fill:  # only long sequences split, per LONG_SPLIT_KEYS, <= 8 ways
            return TILE_KEYS, 0
        splits = min(-(-fill // programs), MAX_SPLITS)
        return (SMALL_TILE_KEYS if splits >= 16 else TILE_KEYS), _pow2(splits)

    def program_keys(num_reqs: int, max_kv: int) -> int:
        if num_reqs <= 0 or max_kv <= 0:
            return 0
        split = by_batch.get(num_reqs)
        if split is None:
            split = by_batch[num_reqs] = split_of(num_reqs)
        tile, ways = split
        tiles = -(-max_kv // tile)
        if ways:
            return -(-tiles // ways) * tile
        per = -(-tiles // MAX_LONG_SPLITS)
        if per < long_tiles:
            per = long_tiles
        return (tiles if tiles < per else per) * TILE_KEYS

    return program_keys


def tail_keys_fn(num_kv_heads: int, sms: int) -> TailKeysFn:
    """`(num_reqs, kv_read_tokens, max_kv_tokens) -> tail_keys`: the keys the longest attention
    program walks beyond the program of a row at the batch's mean context (kv_read_tokens /
    num_reqs, rounded up), at most TAIL_CAP_KEYS. 0 for a batch of one context length (the
    sweep's uniform rows, which the decode table is fitted on).

    Why (reports/fidelity/decode_tail.py): a batch of mixed context lengths does the same
    attention work as a uniform one at its mean, but its kernel ends when its longest
    programs do. On the H100 the runs' clean queued decode steps sit above the sweep-fitted
    table by a time proportional to these keys (~23 ns a key a layer on llama3-8b and
    llama3.2-1b alike: replay.analysis.decodetail), the run-vs-sweep gap that grew with the
    batch (its tails grow with it). Past the cap a long row is split and the decode model's
    straggler branch (`program_keys`) holds it."""
    keys = program_keys_fn(num_kv_heads, sms)

    def tail_keys(num_reqs: int, kv_read: int, max_kv: int) -> int:
        if num_reqs <= 0 or max_kv <= 0:
            return 0
        mean = -(-kv_read // num_reqs)
        return min(max(keys(num_reqs, max_kv) - keys(num_reqs, mean), 0), TAIL_CAP_KEYS)

    return tail_keys
