"""VeriCache's lossy_kv drafter on tiny models: lossless with every compressor (greedy, ragged draft
lengths, preemption, aborts mid-round), exact sampling path, and a drafter that really drafts."""
import pytest
import torch
from specserve.kv_cache.storage import KVStorage
from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams
from specserve.spec_phases import loader
from specserve.spec_phases.model import ModelConfig
from specserve.kv_cache.draft_pool import DraftPool
from specserve.spec_phases.proposers.base import DraftRequest
from specserve.spec_phases.calibration import build_compressor
from specserve.spec_phases.proposers import lossy_kv
from specserve.spec_phases.proposers.lossy_kv import LossyKVProposer

SMALL_PAGES = {"num_sink": 4, "window": 8, "page_size": 8}
COMPRESSORS = {                                   # name -> (kv_compressor, config, tiny head_dim)
    "window": ("window", SMALL_PAGES, 16),
    "quant": ("quant", {**SMALL_PAGES, "key_bits": 4, "value_bits": 2}, 16),
    "spherical": ("spherical", {**SMALL_PAGES, "tier": 1, "value_bits": 8, "calib_tokens": 128},
                  16),
    "mustafar": ("mustafar", {"num_sink": 4, "window": 8, "page_size": 64, "sparsity": 0.7}, 64),
}


def tiny_d64(vocab_size: int = 49152, max_position: int = 4096) -> ModelConfig:
    """The tiny model with head_dim 64: Mustafar's bitmap tiles need head_dim % 64 == 0."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=128, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=64, max_position=max_position,
                       bos_token_id=1, eos_token_ids=(2,))


def prompts(n=4):
    return [[(7 * j * (i + 1) + i) % 900 + 3 for j in range(90 + 13 * i)] for i in range(n)]


def spec(name, k=8):
    comp, cfg, _ = COMPRESSORS[name]
    return SpeculativeConfig(method="lossy_kv", num_speculative_tokens=k, kv_compressor=comp,
                             kv_compressor_config=cfg)


def generate(core, params_list, abort_after=None):
    for i, (ids, p) in enumerate(zip(prompts(len(params_list)), params_list)):
        core.add_request(EngineRequest(f"q{i}", ids, p))
    outs = {f"q{i}": [] for i in range(len(params_list))}
    drafted = accepted = steps = 0
    pool = core.worker.draft_pool
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        if pool is not None and pool.states:
            core.last_bytes_used = pool.usage()           # while requests are held
        drafted += step.stats.num_draft_tokens
        accepted += step.stats.num_accepted_tokens
        core.total_preemptions = getattr(core, "total_preemptions", 0) + step.stats.num_preemptions
        steps += 1
        if abort_after is not None and steps == abort_after:
            for rid in list(outs)[::2]:
                core.abort_request(rid)
    return [outs[f"q{i}"] for i in range(len(params_list))], drafted, accepted


@pytest.fixture
def engine(make_engine, monkeypatch):
    def make(head_dim, **kwargs):
        if head_dim == 64:
            monkeypatch.setattr(loader, "tiny_config", tiny_d64)
        return make_engine(num_threads=1, **kwargs)
    return make


GREEDY = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, num_speculative_tokens=c)
          for c in (None, 3, None, 0)]


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_greedy_output_is_identical_for_every_compressor(engine, name):
    head_dim = COMPRESSORS[name][2]
    plain, _, _ = generate(engine(head_dim), GREEDY)
    core = engine(head_dim, speculative=spec(name))
    out, drafted, accepted = generate(core, GREEDY)
    assert out == plain
    assert drafted > 0 and 0 <= accepted <= drafted
    prop = core.worker.proposer
    stats = prop.stats()
    assert stats["num_encoded_tokens"] >= sum(len(p) for p in prompts(3))
    assert stats["num_draft_steps"] >= 8
    # pages really were compressed: the held states are smaller than fp16 dense
    used = core.last_bytes_used
    dense = (used.num_tokens * prop.pool.comp.config.dense_bytes_per_token()
             * core.worker.model_config.num_layers)
    assert used.num_tokens > 0 and used.compressed_bytes < 0.8 * dense


@pytest.mark.parametrize("name", ["window", "mustafar"])
def test_preemption_and_tight_pools_stay_lossless(engine, name):
    head_dim = COMPRESSORS[name][2]
    plain, _, _ = generate(engine(head_dim), GREEDY)
    # the token budget alone schedules prompt chunks (no time credit: the steps, and so the
    # preemptions, do not depend on measured times); 28 blocks of 8, as admission reserves a
    # prompt's KV, so that the running requests' growth overflows the pool
    core = engine(head_dim, speculative=spec(name), num_kv_blocks=28, block_size=8,
                  max_num_batched_tokens=64, max_decode_slowdown=None)
    out, drafted, _ = generate(core, GREEDY)
    assert out == plain and drafted > 0
    assert core.total_preemptions > 0


def test_abort_mid_round_drops_states_and_frees_blocks(engine):
    core = engine(16, speculative=spec("quant"))
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for _ in range(4)]
    out, _, _ = generate(core, params, abort_after=6)
    assert [len(o) for o in out][1::2] == [40, 40] and all(len(o) < 40 for o in out[::2])
    core.step()                                        # releases the last finished requests
    assert core.worker.draft_pool.states == {}
    core.check_integrity()


def test_seeded_sampling_is_reproducible_and_counts_are_consistent(engine):
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=i,
                             ignore_eos=True) for i in range(3)]
    core = engine(16, speculative=spec("window", k=4))
    out, drafted, accepted = generate(core, params)
    assert all(len(o) == 16 for o in out) and drafted > 0 and accepted <= drafted
    again, _, _ = generate(engine(16, speculative=spec("window", k=4)), params)
    assert again == out


def test_a_lossless_drafting_cache_drafts_what_the_target_says(engine, monkeypatch):
    """With a window wider than any context nothing is compressed: the drafter is the target itself
    (fp16 K/V), so almost every draft must be accepted. Catches position, scratch and merge bugs.
    (The drafts' vocabulary is the whole one: a random model's tokens are not its contexts'.)"""
    monkeypatch.setattr(lossy_kv, "DRAFT_VOCAB_PREFIX", 1 << 30)
    full = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=6, kv_compressor="window",
                             kv_compressor_config={"window": 1 << 20})
    core = engine(16, speculative=full)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(2)]
    _, drafted, accepted = generate(core, params)
    assert drafted > 0 and accepted >= 0.9 * drafted


def test_sync_mirrors_the_full_cache_and_rebuilds_after_rollback():
    torch.manual_seed(0)
    model = loader.load_model("tiny-random")
    cfg = model.config
    storage = KVStorage(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    storage.k.normal_()
    storage.v.normal_()
    blocks = [5, 2, 9, 0, 7, 11, 3, 1, 4, 6]                  # scattered: exercises the block table
    tokens = [(5 * j) % 300 + 3 for j in range(31)]

    def ask(prop, n):
        return prop.propose([DraftRequest("r", tuple(tokens[:n + 1]), n, blocks)], [4]).token_ids[0]

    def drafter():
        comp = build_compressor("quant", model, dict(SMALL_PAGES))
        return LossyKVProposer(model, DraftPool(comp, storage, "cpu"))

    prop = drafter()
    ask(prop, 30)
    state = prop.pool.states["r"]
    assert state.num_tokens == 30 and len(state.layers[0].pages) == 2
    slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(4)])
    assert torch.equal(state.layers[1].sink_k, storage.k[1][slots].half())
    tail = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(state.layers[0].tail_start, 30)])
    assert torch.equal(state.layers[0].tail_v, storage.v[0][tail].half())
    # preempted, recomputed to a shorter prefix
    rolled = ask(prop, 12)
    assert prop.pool.num_rebuilds == 1 and prop.pool.states["r"].num_tokens == 12
    assert rolled == ask(drafter(), 12)
    prop.pool.release(["r"])
    assert prop.pool.states == {} and prop.pool.usage().num_tokens == 0


def test_compressor_settings_are_checked():
    model = loader.load_model("tiny-random")
    with pytest.raises(ValueError, match="unknown KV compressor"):
        build_compressor("zip", model, {})
    with pytest.raises(ValueError, match="bogus"):
        build_compressor("quant", model, {"bogus": 1})
    d64 = loader.build_random_model(tiny_d64())
    assert build_compressor("mustafar", d64, {"sparsity": 0.5}).key_sparsity == 0.5


def test_full_cache_in_the_host_pool_is_lossless(make_engine):
    """VeriCache's two pools wired into the engine: the full cache lives in a HostKVPool and every
    forward stages it layer by layer; greedy output equals plain decoding and bytes are counted."""
    from dataclasses import replace

    from specserve.kv_cache.host_pool import HostKVPool
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in range(3)]
    plain, _, _ = generate(make_engine(), params)
    core = make_engine(speculative=replace(spec("quant"), full_kv_in_host=True))
    assert isinstance(core.worker.storage, HostKVPool)
    out, drafted, _ = generate(core, params)
    assert out == plain and drafted > 0
    assert core.worker.storage.bytes_h2d > 0 and core.worker.storage.bytes_d2h > 0
