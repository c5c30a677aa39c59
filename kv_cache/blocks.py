"""Block pool: ref counts, a free queue, and the prefix-cache index. Pure bookkeeping, no tensors.

Every block is in exactly one state:
    owned   ref_cnt > 0 (held by one or more requests; shared prefix blocks have ref_cnt > 1)
    cached  ref_cnt == 0, still hashed: in the free queue, reusable by a prefix hit until evicted
    free    ref_cnt == 0, no hash: in the free queue
Allocation pops the free queue's head (least recently freed); a cached block popped there loses its
hash (lazy eviction). A prefix hit on a cached block takes it out of the free queue.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 name: str = "main"):
        if num_blocks < 1:
            raise ValueError("a pool needs at least one block")
        self.name = name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}             # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached)."""
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self.free_queue):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each. Callers pass a request's blocks tail first, so the tail of a
        sequence is evicted before its (more shareable) head."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"double free of block {block_id} in pool {self.name!r}")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """A cached or owned block holding exactly `tokens` under `block_hash` (tokens compared, so
        a hash collision can never return wrong KV)."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.block_tokens[block_id] != tokens:
            return None
        return block_id

    def cache_block(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:                 # same content already cached in another block
            return
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tokens
        self.cached[block_hash] = block_id

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None

    def check_integrity(self, owners: dict[int, int]) -> None:
        """owners: block id -> number of block-table references. Raises with a report on any
        leak."""
        problems = []
        for block_id in range(self.num_blocks):
            expected = owners.get(block_id, 0)
            if self.ref_cnt[block_id] != expected:
                problems.append(f"block {block_id}: ref_cnt {self.ref_cnt[block_id]} but "
                                f"{expected} owners")
            in_queue = block_id in self.free_queue
            if in_queue != (expected == 0):
                problems.append(f"block {block_id}: in free queue={in_queue} with {expected} "
                                "owners")
        for block_hash, block_id in self.cached.items():
            if self.block_hash[block_id] != block_hash:
                problems.append(f"cache index points hash {block_hash} at block {block_id} with "
                                f"another hash")
        num_owned = sum(1 for c in self.ref_cnt if c > 0)
        num_cached = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        num_free = len(self.free_queue) - num_cached
        if num_owned + num_cached + num_free != self.num_blocks:
            problems.append(f"owned {num_owned} + cached {num_cached} + free {num_free} != "
                            f"{self.num_blocks}")
        if problems:
            raise AssertionError(f"KV pool {self.name!r} integrity:\n  "
                                 + "\n  ".join(problems[:20]))
