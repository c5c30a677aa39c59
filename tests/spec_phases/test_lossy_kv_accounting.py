"""VeriCache accounting the scheduler can admit by: compressed (device) bytes used by the drafting
caches, their capacity, the predicted bytes of a request at n tokens, bytes per token per pool."""
from dataclasses import replace

import pytest
import torch
from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.sampling_params import SamplingParams

SPEC = SpeculativeConfig(method="lossy_kv", num_speculative_tokens=4, kv_compressor="quant",
                         kv_compressor_config={"num_sink": 4, "window": 8, "page_size": 8,
                                               "key_bits": 4,
                                               "value_bits": 2})


def run(core, num=3, max_tokens=10):
    for i in range(num):
        core.add_request(EngineRequest(f"a{i}", [(5 * j + i) % 400 + 3 for j in range(40 + 17 * i)],
                                       SamplingParams(max_tokens=max_tokens, temperature=0,
                                                      ignore_eos=True)))
    seen = []
    while core.has_unfinished():
        core.step()
        pool = core.worker.draft_pool
        usage = pool.usage()
        if pool.states:
            predicted = sum(pool.bytes_at(s.num_tokens) for s in pool.states.values())
            seen.append((usage, predicted))
    return seen


def test_used_bytes_equal_the_prediction_and_undercut_the_full_pool(make_engine):
    core = make_engine(speculative=SPEC, num_threads=1)
    seen = run(core)
    assert seen
    cfg = core.worker.model_config
    for usage, predicted in seen:
        assert usage.compressed_bytes == predicted > 0
        assert usage.compressed_bytes < usage.full_bytes
        # the default full cache on the CPU: bf16 (`--kv-cache-dtype auto`, `--dtype auto`)
        assert core.worker.kv_dtype == torch.bfloat16
        assert (usage.full_bytes_per_token
                == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2)
        assert (usage.dense_bytes_per_token
                == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2)
        assert 0 < usage.compressed_page_bytes_per_token < usage.dense_bytes_per_token
        # full cache device-resident: not budgeted
        assert usage.capacity_bytes is None
    # a long request's cache grows by the page rate, not the dense rate
    w = core.worker
    grow = w.draft_pool.bytes_at(1000 + 800) - w.draft_pool.bytes_at(1000)
    assert grow == pytest.approx(800 * seen[0][0].compressed_page_bytes_per_token)
    core.step()
    assert core.worker.draft_pool.usage().compressed_bytes == 0      # released with the requests


def test_capacity_is_the_device_budget_when_the_full_cache_is_in_host_memory(make_engine):
    core = make_engine(speculative=replace(SPEC, full_kv_in_host=True), num_threads=1,
                       kv_cache_memory_gb=0.03)
    assert core.worker.draft_pool.usage().capacity_bytes == int(0.03 * 2**30)


def test_no_drafting_cache_without_lossy_kv(make_engine):
    core = make_engine(speculative=SpeculativeConfig(method="ngram", prompt_lookup_min=1,
                                                     prompt_lookup_max=4))
    assert core.worker.draft_pool is None and core.kv.draft_budget is None


def test_warm_up_times_the_drafter_for_faser_without_counting_it_as_drafting(make_engine):
    """With FASER's controller the warm-up times lossy_kv's draft passes over synthetic states of
    two context lengths (`Worker.calibrate_drafter`): the pass is priced and exploring is off
    before the first request, the drafter's counters and pool stay untouched, and output stays
    plain decoding's."""
    spec = replace(SPEC, adaptive=True)
    core = make_engine(speculative=spec, num_threads=1, max_model_len=256)
    plain = make_engine(num_threads=1, max_model_len=256)
    core.warm_up()
    cost = core.scheduler.cost
    assert cost.unpriced_drafting_steps == 0
    keys = sorted({p.keys for p in cost.passes})
    assert len(cost.passes) == 4 and keys == [63, 64, 253, 254]      # 256 - 3 and a quarter
    assert all(p.rows == 1 and p.seconds > 0 for p in cost.passes)
    assert cost.prices.draft_pass + cost.prices.pass_key > 0
    assert cost.state_price > 0                       # a request's first round encodes it all
    proposer = core.worker.proposer
    assert proposer.num_rounds == proposer.num_draft_steps == 0
    assert not core.worker.draft_pool.states
    outs = []
    for engine in (core, plain):
        engine.add_request(EngineRequest("r", [(7 * j) % 300 + 3 for j in range(90)],
                                         SamplingParams(max_tokens=12, temperature=0,
                                                        ignore_eos=True)))
        outs.append([t for o in engine.run_until_idle() for t in o.new_token_ids])
    assert outs[0] == outs[1] and len(outs[0]) == 12
