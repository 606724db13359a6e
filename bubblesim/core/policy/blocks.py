"""Paged KV block accounting with prefix caching.

Invariants (checked by `check_invariants`, used in tests):
- every block is either referenced (refcount > 0) by >= 1 request or on the free queue, never both;
- a block referenced by several requests is a cached prefix block (it has a content hash);
- `hash_to_block[h] == b` implies `block_hash[b] == h`.
Free blocks keep their hash (a cached prefix may be reused) until they are handed out again;
the free queue is ordered so the least recently freed block is reused first.

Two representations of one state, handing out the same ids in the same order:
- plain, while no block has a content hash: then every held block has refcount 1 and every
  returned block refcount 0, so no per-block state is kept; the returned free blocks are the
  list `_queue[_head:]` in reuse order, and allocate/release move whole runs of ids by slicing
  (a request's blocks in one C call instead of a Python loop per block id);
- linked: per-block refcounts and hashes and a `_FreeQueue` (O(1) removal of any free block, for
  prefix-cache hits). The manager switches to it, once and for good, when the first content hash
  is registered, or when `free`, `refcount` or `block_hash` is read (tests inspect those).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from bubblesim.core.request import Request

_NONE = -1


class _FreeQueue:
    """The free blocks in reuse order: first the fresh blocks, never handed out (ids `fresh` ..
    num_blocks - 1, in id order: a block is taken fresh before any returned one), then the
    returned blocks as a doubly linked list (O(1) popleft, append and remove of any block).
    Per-block lists cover ids below `fresh` only, so a huge cache costs nothing up front."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.fresh = 0
        self.prev: list[int] = []
        self.next: list[int] = []
        self.on: list[bool] = []  # on the linked list (free), for ids below `fresh`
        self.head = self.tail = _NONE
        self.size = num_blocks

    def is_free(self, b: int) -> bool:
        return b >= self.fresh or self.on[b]

    def take_fresh(self, k: int) -> range:
        """The next k fresh blocks (k <= num_blocks - fresh), now off the queue."""
        lo = self.fresh
        self.prev.extend([_NONE] * k)
        self.next.extend([_NONE] * k)
        self.on.extend([False] * k)
        self.fresh = lo + k
        self.size -= k
        return range(lo, lo + k)

    def popleft(self) -> int:
        if self.fresh < self.num_blocks:
            return self.take_fresh(1)[0]
        b = self.head
        self.remove(b)
        return b

    def remove(self, b: int) -> None:
        """Unlink a returned block (b < fresh)."""
        p, n = self.prev[b], self.next[b]
        if p == _NONE:
            self.head = n
        else:
            self.next[p] = n
        if n == _NONE:
            self.tail = p
        else:
            self.prev[n] = p
        self.on[b] = False
        self.size -= 1

    def scatter(self, seed: int) -> None:
        """Every free block in a seeded random order (all become returned blocks)."""
        ids = list(self.take_fresh(self.num_blocks - self.fresh))
        b = self.head
        while b != _NONE:
            nxt = self.next[b]
            self.remove(b)
            ids.append(b)
            b = nxt
        random.Random(seed).shuffle(ids)
        for b in ids:
            self.append(b)

    def append(self, b: int) -> None:
        self.prev[b], self.next[b] = self.tail, _NONE
        if self.tail == _NONE:
            self.head = b
        else:
            self.next[self.tail] = b
        self.tail = b
        self.on[b] = True
        self.size += 1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("KV cache has no blocks: the model does not fit in memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.hash_to_block: dict[int, int] = {}
        # plain representation (while `_linked` is False): ids >= `_fresh` were never handed
        # out; `_queue[_head:]` are the returned free blocks in reuse order; `_size` free blocks
        self._linked = False
        self._fresh = 0
        self._queue: list[int] = []
        self._head = 0
        self._size = num_blocks
        # linked representation: per block id below free.fresh (fresh blocks: refcount 0, no hash)
        self._refcount: list[int] = []
        self._block_hash: list[int | None] = []
        self._free = _FreeQueue(num_blocks)

    def _link(self) -> None:
        """Switch to the linked representation (same free blocks, same reuse order)."""
        if self._linked:
            return
        fresh, queue = self._fresh, self._queue[self._head :]
        refcount = [1] * fresh  # plain: every handed-out block not on the queue is held once
        for b in queue:
            refcount[b] = 0
        free = self._free
        free.fresh = fresh
        free.prev, free.next, free.on = [_NONE] * fresh, [_NONE] * fresh, [False] * fresh
        free.size = self.num_blocks - fresh
        for b in queue:
            free.append(b)
        self._refcount, self._block_hash = refcount, [None] * fresh
        self._queue, self._head, self._linked = [], 0, True

    @property
    def free(self) -> _FreeQueue:
        """The free queue (switches to the linked representation)."""
        self._link()
        return self._free

    @property
    def refcount(self) -> list[int]:
        """Per block id below free.fresh (switches to the linked representation)."""
        self._link()
        return self._refcount

    @property
    def block_hash(self) -> list[int | None]:
        """Per block id below free.fresh (switches to the linked representation)."""
        self._link()
        return self._block_hash

    def scatter_free(self, seed: int) -> None:
        """Hand out the free blocks in a seeded random order from now on. A cache that has
        served many requests gives a new request scattered block ids, not a run of consecutive
        ones; `replay shapes` times its synthetic batches over such a layout, as runs have.
        O(free blocks); the set of free blocks is unchanged."""
        if not self._linked:  # as _FreeQueue.scatter: the fresh ids, then the queue, shuffled
            ids = [*range(self._fresh, self.num_blocks), *self._queue[self._head :]]
            random.Random(seed).shuffle(ids)
            self._fresh, self._queue, self._head = self.num_blocks, ids, 0
            return
        fresh = self._free.num_blocks - self._free.fresh  # become returned blocks
        self._refcount.extend([0] * fresh)
        self._block_hash.extend([None] * fresh)
        self._free.scatter(seed)

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._free.size if self._linked else self._size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, req: Request, total_tokens: int) -> int:
        return max(0, self.blocks_for(total_tokens) - len(req.block_ids))

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, req: Request, total_tokens: int) -> bool:
        """Give `req` blocks for `total_tokens` positions; False (and no change) if short."""
        ids = req.block_ids
        need = -(-total_tokens // self.block_size) - len(ids)
        if need <= 0:
            return True
        if self._linked:
            return self._allocate_linked(ids, need)
        if need > self._size:
            return False
        self._size -= need
        fresh = self._fresh
        take = self.num_blocks - fresh
        if take:  # fresh blocks first, in id order
            if need <= take:
                if need == 1:
                    ids.append(fresh)
                else:
                    ids.extend(range(fresh, fresh + need))
                self._fresh = fresh + need
                return True
            ids.extend(range(fresh, self.num_blocks))
            self._fresh = self.num_blocks
            need -= take
        h = self._head
        queue = self._queue
        if need == 1:
            ids.append(queue[h])
        else:
            ids.extend(queue[h : h + need])
        h += need
        if h >= 4096 and 2 * h >= len(queue):  # drop the consumed front (amortized O(1))
            del queue[:h]
            h = 0
        self._head = h
        return True

    def allocate_next(self, reqs: Sequence[Request]) -> bool:
        """One more block for each of `reqs`, in order: what `allocate` hands a decode that
        crosses into its next block, for each of them in turn (the same ids); False (and no
        change) if fewer are free."""
        n = len(reqs)
        if self._linked:
            if n > self._free.size:
                return False
            for r in reqs:
                self._allocate_one(r.block_ids)
            return True
        if n > self._size:
            return False
        self._size -= n
        fresh = self._fresh
        if fresh + n <= self.num_blocks:  # fresh blocks first, in id order
            self._fresh = fresh + n
            for r in reqs:
                r.block_ids.append(fresh)
                fresh += 1
            return True
        queue, h = self._queue, self._head
        for r in reqs:
            if fresh < self.num_blocks:
                r.block_ids.append(fresh)
                fresh += 1
            else:
                r.block_ids.append(queue[h])
                h += 1
        self._fresh = fresh
        if h >= 4096 and 2 * h >= len(queue):  # drop the consumed front (amortized O(1))
            del queue[:h]
            h = 0
        self._head = h
        return True

    def allocate_one(self, req: Request) -> bool:
        """`allocate_next((req,))`: one more block for `req` (the same id), without the
        sequence; False (and no change) if none is free."""
        if self._linked:
            if not self._free.size:
                return False
            self._allocate_one(req.block_ids)
            return True
        if not self._size:
            return False
        self._size -= 1
        fresh = self._fresh
        if fresh < self.num_blocks:  # fresh blocks first, in id order
            self._fresh = fresh + 1
            req.block_ids.append(fresh)
            return True
        queue, h = self._queue, self._head
        req.block_ids.append(queue[h])
        h += 1
        if h >= 4096 and 2 * h >= len(queue):  # drop the consumed front (amortized O(1))
            del queue[:h]
            h = 0
        self._head = h
        return True

    def _allocate_linked(self, ids: list[int], need: int) -> bool:
        free = self._free
        if need > free.size:
            return False
        if need == 1:  # a decode crossing into its next block: the common case
            self._allocate_one(ids)
            return True
        take = min(need, free.num_blocks - free.fresh)
        if take:  # fresh blocks first, in id order
            ids.extend(free.take_fresh(take))
            self._refcount.extend([1] * take)
            self._block_hash.extend([None] * take)
            need -= take
            if not need:
                return True
        # then `need` x free.popleft(), inlined: unlink the first `need` returned blocks
        nxt, on, refcount, block_hash = free.next, free.on, self._refcount, self._block_hash
        b = free.head
        for _ in range(need):
            on[b] = False
            if block_hash[b] is not None:
                self._evict_hash(b)
            refcount[b] = 1
            ids.append(b)
            b = nxt[b]
        free.head = b
        if b == _NONE:
            free.tail = _NONE
        else:
            free.prev[b] = _NONE
        free.size -= need
        return True

    def _allocate_one(self, ids: list[int]) -> None:
        """allocate() of a single block, inlined: a fresh one, else the queue's head."""
        free = self._free
        b = free.fresh
        if b < free.num_blocks:
            free.fresh = b + 1
            free.prev.append(_NONE)
            free.next.append(_NONE)
            free.on.append(False)
            self._refcount.append(1)
            self._block_hash.append(None)
        else:
            b = free.head
            free.on[b] = False
            if self._block_hash[b] is not None:
                self._evict_hash(b)
            self._refcount[b] = 1
            nb = free.next[b]
            free.head = nb
            if nb == _NONE:
                free.tail = _NONE
            else:
                free.prev[nb] = _NONE
        free.size -= 1
        ids.append(b)

    def release(self, req: Request) -> None:
        """Drop `req`'s references; blocks no longer used return to the free queue.
        Tail blocks are queued first so that shared prefix heads stay cached longest."""
        if not self._linked:  # every block held once: all of them return, tail first
            ids = req.block_ids
            self._queue.extend(reversed(ids))
            self._size += len(ids)
            req.block_ids = []
            return
        refcount = self._refcount
        free = self._free
        prev, nxt, on = free.prev, free.next, free.on
        tail = free.tail
        added = 0
        for b in reversed(req.block_ids):
            refcount[b] -= 1
            if refcount[b] == 0:  # free.append(b), inlined
                prev[b] = tail
                nxt[b] = _NONE
                if tail == _NONE:
                    free.head = b
                else:
                    nxt[tail] = b
                tail = b
                on[b] = True
                added += 1
        free.tail = tail
        free.size += added
        req.block_ids = []

    def _evict_hash(self, b: int) -> None:
        h = self._block_hash[b]
        if h is not None:
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self._block_hash[b] = None

    # ---- prefix caching ---------------------------------------------------------------------
    def hashes(self, req: Request) -> list[int]:
        """Content keys of the request's leading full prompt blocks that can be shared: from the
        token ids when the trace has them, else from (prefix_id, block index) inside prefix_len."""
        if req.block_hashes is None:
            bs = self.block_size
            out: list[int] = []
            parent = 0
            ids = req.prompt_ids
            if ids is not None:
                for i in range(req.prompt_len // bs):
                    parent = hash((parent, tuple(ids[i * bs : (i + 1) * bs])))
                    out.append(parent)
            elif req.prefix_id is not None:
                for i in range(min(req.prefix_len, req.prompt_len) // bs):
                    parent = hash((parent, req.prefix_id, i))
                    out.append(parent)
            req.block_hashes = out
        return req.block_hashes

    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks for the request's prompt prefix; returns cached tokens.
        At least one prompt token is always left to compute (it produces the first logits)."""
        if not self.prefix_caching or req.block_ids:
            return 0
        hit: list[int] = []
        for h in self.hashes(req):
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hit.append(b)
        if hit:  # a hash is registered, so the manager is linked
            refcount = self._refcount
            for b in hit:
                if refcount[b] == 0:
                    self._free.remove(b)
                refcount[b] += 1
        req.block_ids = hit
        return min(len(hit) * self.block_size, req.prompt_len - 1)

    def cache_blocks(self, req: Request, num_computed: int) -> None:
        """Register the request's full prompt blocks whose KV is written (or being written by a
        launched batch: the stream orders any later reader after it)."""
        if not self.prefix_caching or (req.prompt_ids is None and req.prefix_id is None):
            return  # (no content key: `hashes` has none, nothing to share)
        hashes = self.hashes(req)
        upto = min(len(hashes), num_computed // self.block_size, len(req.block_ids))
        if upto <= 0:
            return
        self._link()  # blocks with a hash can be shared: per-block refcounts from here on
        block_hash = self._block_hash
        for i in range(upto):
            b = req.block_ids[i]
            if block_hash[b] is not None:
                continue
            h = hashes[i]
            if h in self.hash_to_block:
                continue  # another block already holds this content; keep the first
            block_hash[b] = h
            self.hash_to_block[h] = b

    # ---- checks -----------------------------------------------------------------------------
    def check_invariants(self, requests: Sequence[Request]) -> None:
        if not self._linked:
            self._check_plain(requests)
            return
        free = self._free
        used = free.fresh  # blocks at or above it were never handed out
        assert len(self._refcount) == len(self._block_hash) == len(free.on) == used
        refs = [0] * used
        for r in requests:
            for b in r.block_ids:
                assert 0 <= b < used, f"block {b} held but never handed out"
                refs[b] += 1
        for b in range(used):
            assert refs[b] == self._refcount[b], (
                f"block {b}: refcount {self._refcount[b]} != {refs[b]}"
            )
            assert (refs[b] == 0) == free.on[b], f"block {b}: free={free.on[b]} refs={refs[b]}"
            if refs[b] > 1:
                assert self._block_hash[b] is not None, (
                    f"block {b} shared by {refs[b]} without a hash"
                )
        assert free.size == sum(free.on) + self.num_blocks - used
        for h, b in self.hash_to_block.items():
            assert self._block_hash[b] == h

    def _check_plain(self, requests: Sequence[Request]) -> None:
        """The plain representation: no hashes, every handed-out block held by exactly one
        request or on the queue, never both."""
        assert not self.hash_to_block, "a registered hash while not linked"
        used = self._fresh
        held = [b for r in requests for b in r.block_ids]
        queued = self._queue[self._head :]
        assert all(0 <= b < used for b in held), "a block held but never handed out"
        assert all(0 <= b < used for b in queued), "a queued block never handed out"
        assert len(set(held)) == len(held), "a block held twice without a hash"
        assert len(set(queued)) == len(queued), "a block queued twice"
        assert not set(held) & set(queued), "a block both held and free"
        assert len(held) + len(queued) == used, "a handed-out block neither held nor free"
        assert self._size == self.num_blocks - used + len(queued)
