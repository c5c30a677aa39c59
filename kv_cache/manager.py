"""KV cache manager: per-request block tables over one or more block pools, and the drafting
cache's byte ledger.

Memory answers; the scheduler decides. `allocate` returns the new block ids or None and never
evicts a running request. With several block pools every request holds a table in each; with
VeriCache's drafting cache (`kv_cache/draft_pool.py`) the request's compressed bytes are reserved
too. An allocation succeeds in all of them or changes nothing.

A request's slots:
    | computed (prefix hit | computed here) | new tokens | lookahead (drafts) | unused tail |
"""
from __future__ import annotations

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.draft_pool import DraftBudget

_ROOT_HASH = 0x5EED


class KVCacheManager:
    def __init__(self, pools: list[BlockPool], draft_budget: DraftBudget | None = None):
        if not pools or len({p.block_size for p in pools}) != 1:
            raise ValueError("pools must share one block size")
        if len({p.name for p in pools}) != len(pools):
            raise ValueError("pool names must be unique")
        self.pools = {p.name: p for p in pools}
        self.block_size = pools[0].block_size
        # prefix caching needs every pool to hold the same tokens: only with one pool for now
        self.enable_caching = len(pools) == 1 and pools[0].enable_caching
        self.block_tables: dict[str, dict[str, list[int]]] = {p.name: {} for p in pools}
        self.block_hashes: dict[str, list[int]] = {}      # chained hashes of cached blocks
        self.draft_budget = draft_budget

    @property
    def primary(self) -> BlockPool:
        return next(iter(self.pools.values()))

    def block_ids(self, request_id: str, pool: str | None = None) -> list[int]:
        return self.block_tables[pool or self.primary.name].get(request_id, [])

    def usage(self) -> float:
        return max(p.usage() for p in self.pools.values())

    def match_prefix(self, request_id: str, token_ids: list[int]) -> int:
        """For a request holding no blocks: take the longest run of cached full blocks matching its
        tokens and return how many tokens they cover. At least one token is always left to compute,
        so the step that finishes the prompt has logits to sample from."""
        if self.block_ids(request_id):
            raise RuntimeError(f"match_prefix on {request_id} which already holds blocks")
        hits, hashes = self._cached_prefix(token_ids)
        if hits:
            self.primary.touch(hits)
            self.block_tables[self.primary.name][request_id] = hits
            self.block_hashes[request_id] = hashes
        return len(hits) * self.block_size

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """The tokens `match_prefix` would cover now, taking nothing (the scheduler's estimate of
        a waiting prompt's work)."""
        return len(self._cached_prefix(token_ids)[0]) * self.block_size

    def _cached_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """The cached full blocks matching token_ids from the start, and their chained hashes;
        the last token is never covered."""
        if not self.enable_caching:
            return [], []
        pool, bs = self.primary, self.block_size
        hits, hashes, parent = [], [], _ROOT_HASH
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            tokens = tuple(token_ids[start:start + bs])
            parent = hash((parent, tokens))
            block_id = pool.lookup(parent, tokens)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(parent)
        return hits, hashes

    def allocate(self, request_id: str, num_total_tokens: int,
                 num_computed_tokens: int = 0) -> list[int] | None:
        """Grow the request's tables to cover `num_total_tokens` slots (computed + new + lookahead)
        and its drafting-cache reservation to cover both lengths. Returns the primary pool's newly
        added block ids ([] if none were needed), or None, changing nothing, when something cannot
        cover them."""
        need = -(-num_total_tokens // self.block_size)
        wanted = {name: need - len(self.block_tables[name].get(request_id, []))
                  for name in self.pools}
        if any(n > self.pools[name].num_free_blocks for name, n in wanted.items()):
            return None
        budget = self.draft_budget
        if budget is not None and not budget.reserve(request_id, num_computed_tokens,
                                                     num_total_tokens):
            return None
        added: list[int] = []
        for name, n in wanted.items():
            if n <= 0:
                continue
            new = self.pools[name].allocate(n)
            assert new is not None
            self.block_tables[name].setdefault(request_id, []).extend(new)
            if name == self.primary.name:
                added = new
        return added

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Release whole blocks past the first `num_tokens` slots (after rejected drafts)."""
        keep = -(-num_tokens // self.block_size)
        for name, pool in self.pools.items():
            table = self.block_tables[name].get(request_id)
            if table and len(table) > keep:
                tail = table[keep:]
                del table[keep:]
                pool.free(tail[::-1])
        hashes = self.block_hashes.get(request_id)
        if hashes and len(hashes) > keep:
            del hashes[keep:]

    def free(self, request_id: str) -> None:
        for name, pool in self.pools.items():
            table = self.block_tables[name].pop(request_id, None)
            if table:
                pool.free(table[::-1])
        self.block_hashes.pop(request_id, None)
        if self.draft_budget is not None:
            self.draft_budget.free(request_id)

    def cache_full_blocks(self, request_id: str, token_ids: list[int],
                          num_computed_tokens: int) -> None:
        """Index the request's blocks that are full of computed, committed tokens."""
        if not self.enable_caching:
            return
        pool, bs = self.primary, self.block_size
        table = self.block_tables[pool.name].get(request_id, [])
        hashes = self.block_hashes.setdefault(request_id, [])
        num_full = min(num_computed_tokens // bs, len(table))
        parent = hashes[-1] if hashes else _ROOT_HASH
        for i in range(len(hashes), num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash((parent, tokens))
            hashes.append(parent)
            pool.cache_block(table[i], parent, tokens)

    def check_integrity(self) -> None:
        """free + cached + owned == total in every pool, ref counts equal block-table references."""
        for name, pool in self.pools.items():
            owners: dict[int, int] = {}
            for table in self.block_tables[name].values():
                for block_id in table:
                    owners[block_id] = owners.get(block_id, 0) + 1
            pool.check_integrity(owners)
        if self.draft_budget is not None:
            holders = {r for r, t in self.block_tables[self.primary.name].items() if t}
            self.draft_budget.check_integrity(holders)

    def num_requests_holding_blocks(self) -> int:
        return sum(1 for t in self.block_tables[self.primary.name].values() if t)
