"""VeriCache's host pool: a verify forward with the full cache in host memory, staged to the device
layer by layer, gives exactly the device-resident result and writes the new K/V back to the host."""
import torch
from specserve.kv_cache.host_pool import HostKVPool, StagedPagedAttention
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases import loader
from specserve.spec_phases.runner import ModelRunner


def test_staged_verify_forward_matches_the_device_resident_cache():
    torch.manual_seed(0)
    model = loader.load_model("tiny-random")
    cfg = model.config
    storage = KVStorage(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    pool = HostKVPool(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    storage.k.normal_()
    storage.v.normal_()
    pool.k.copy_(storage.k)
    pool.v.copy_(storage.v)
    runner = ModelRunner(model, storage)
    # three requests, ragged verify rows [last token + drafts] after 21, 9 and 30 cached tokens
    tables = [[7, 3, 20, 11, 5, 0, 30], [2, 9, 14, 26], [1, 4, 6, 8, 10, 12, 16, 18, 22, 24]]
    tokens = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15]]
    starts = [21, 9, 30]
    ids, positions, paged = runner._inputs(tokens, starts, tables)
    want = model(ids, positions, paged)
    meta = paged.meta
    staged = StagedPagedAttention(pool, meta.query_start, meta.seq_lens, tables, paged.slot_mapping,
                                  runner.layers, "cpu")
    got = model(ids, positions, staged)
    assert torch.equal(got, want)
    used = sorted({b for t in tables for b in t})
    # write-back: host == device-resident cache
    for layer in range(cfg.num_layers):
        assert (torch.equal(pool.k[layer], storage.k[layer])
                and torch.equal(pool.v[layer], storage.v[layer]))
    per_layer = 2 * len(used) * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert pool.bytes_h2d == cfg.num_layers * per_layer     # each layer staged exactly once
    assert pool.bytes_d2h == cfg.num_layers * 2 * ids.numel() * cfg.num_kv_heads * cfg.head_dim * 4
