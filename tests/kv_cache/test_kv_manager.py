import pytest

from specserve.kv_cache.blocks import BlockPool
from specserve.kv_cache.manager import KVCacheManager


def manager(num_blocks=8, block_size=4, caching=True):
    return KVCacheManager([BlockPool(num_blocks, block_size, caching)])


def test_allocate_grows_tables_and_returns_none_when_full():
    kv = manager(num_blocks=4)
    assert kv.allocate("a", 5) == [0, 1]              # 5 slots -> 2 blocks
    assert kv.allocate("a", 8) == []                  # still 2 blocks
    assert kv.allocate("b", 9) is None                # needs 3, only 2 free: nothing changes
    assert kv.block_ids("b") == []
    assert kv.allocate("b", 8) == [2, 3]
    assert kv.usage() == 1.0
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.usage() == 0.0
    kv.check_integrity()


@pytest.mark.parametrize("num_tokens", [0, 1, 4, 5, 8, 9])
def test_rollback_keeps_exactly_the_blocks_needed(num_tokens):
    kv = manager()
    kv.allocate("a", 12)
    kv.rollback("a", num_tokens)
    assert len(kv.block_ids("a")) == -(-num_tokens // 4)
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()


def test_double_free_is_detected():
    pool = BlockPool(2, 4)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError):
        pool.free(ids)


def test_integrity_check_catches_a_leak():
    kv = manager()
    kv.allocate("a", 4)
    kv.block_tables["full" if "full" in kv.pools else "main"].pop("a")   # lose the table: a leak
    with pytest.raises(AssertionError, match="ref_cnt"):
        kv.check_integrity()


def test_prefix_hit_on_freed_blocks_compares_tokens():
    kv = manager(block_size=4)
    tokens = list(range(10))                          # 2 full blocks + 2 tokens
    kv.allocate("a", 10)
    kv.cache_full_blocks("a", tokens, 10)
    a_blocks = kv.block_ids("a")[:2]
    kv.free("a")                                      # cached, not owned
    kv.check_integrity()
    assert kv.match_prefix("b", tokens) == 8          # hit on freed (cached) blocks
    assert kv.block_ids("b") == a_blocks
    kv.check_integrity()
    assert kv.match_prefix("c", tokens[:4] + [99] * 6) == 4    # diverges in block 2
    assert kv.match_prefix("d", [7] + tokens[1:]) == 0         # diverges in block 1
    for r in "bcd":
        kv.free(r)
    kv.check_integrity()


@pytest.mark.parametrize("length", [8, 9])
def test_prefix_hit_always_leaves_a_token_to_compute(length):
    kv = manager(block_size=4)
    tokens = list(range(length))
    kv.allocate("a", length)
    kv.cache_full_blocks("a", tokens, length)
    kv.free("a")
    hit = kv.match_prefix("b", tokens)
    # length % bs == 0: the last block is recomputed
    assert hit == 4 if length == 8 else hit == 8
    assert hit < length
    kv.free("b")
    kv.check_integrity()


def test_cached_blocks_are_evicted_lazily_when_allocation_needs_them():
    kv = manager(num_blocks=3, block_size=4)
    tokens = list(range(8))
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", tokens, 8)
    kv.free("a")
    assert len(kv.primary.cached) == 2
    assert kv.allocate("b", 12) is not None           # takes all three, evicting both cached blocks
    assert kv.primary.cached == {}
    assert kv.match_prefix("c", tokens) == 0
    kv.free("b")
    kv.check_integrity()


def test_shared_prefix_blocks_are_ref_counted():
    kv = manager(block_size=4)
    tokens = list(range(9))
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", tokens, 9)
    assert kv.match_prefix("b", tokens) == 8          # shares a's two full blocks while a runs
    shared = kv.block_ids("b")
    assert all(kv.primary.ref_cnt[b] == 2 for b in shared)
    kv.check_integrity()
    kv.free("a")
    assert all(kv.primary.ref_cnt[b] == 1 for b in shared)
    kv.free("b")
    kv.check_integrity()


def test_two_pools_allocate_all_or_nothing():
    kv = KVCacheManager([BlockPool(8, 4, name="device"), BlockPool(2, 4, name="host")])
    assert not kv.enable_caching
    assert kv.allocate("a", 8) is not None
    assert kv.allocate("b", 4) is None                # host pool is full: device pool untouched
    assert kv.block_ids("b", "device") == []
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()
