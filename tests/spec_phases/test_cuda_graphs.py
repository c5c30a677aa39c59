"""Step graphs (spec_phases/cuda_graphs.py) on the CPU: the static-buffer body a CUDA graph
captures, run eagerly under TRITON_INTERPRET=1, computes the hidden states and the KV writes of the
runner's eager forward over the same decode and verify steps bitwise (one split or several),
padded rows touch only the padding block, and only batches that fit a captured shape are served.
Capture and replay themselves need a GPU (docs/BENCHMARKS.md §7.2 has the run on one)."""
from __future__ import annotations

import pytest

from specserve.scheduler.config import EngineConfig
from specserve.server.cli import build_parser, engine_config
from specserve.spec_phases.cuda_graphs import capture_sizes, query_lens

CHILD = r'''
import sys
from dataclasses import replace
import torch
from specserve.kernels.triton import paged_attention as pa
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.cuda_graphs import StepGraphs
from specserve.spec_phases.loader import build_random_model, tiny_config
from specserve.spec_phases.runner import ModelRunner

pa.SPLIT_TOKENS = int(sys.argv[1])              # 1024: one split everywhere; 64: several
model = build_random_model(tiny_config(vocab_size=300, max_position=512), seed=5)
assert model.pack_for_cpu()          # the C kernel's rows do not depend on the batch's rows
cfg, blocks, bs = model.config, 130, 4
make = lambda pad: KVStorage(cfg.num_layers, blocks, bs, cfg.num_kv_heads,  # noqa: E731
                             cfg.head_dim, torch.float32, "cpu", padding_block=pad)
eager_cache, graph_cache = make(False), make(True)
eager = ModelRunner(model, eager_cache)
graphs = StepGraphs(model, graph_cache, max_batch=8, max_model_len=cfg.max_position,
                    num_speculative_tokens=3, capture=False)
assert graphs.sizes == [1, 2, 4, 8] and graphs.query_lens == [1, 4]
assert graphs.table_width == 128
graphed = ModelRunner(model, graph_cache, graphs)
g = torch.Generator().manual_seed(2)
lens = (70, 9, 33, 5, 17)
prompts = [tuple(torch.randint(0, 300, (n,), generator=g).tolist()) for n in lens]
tables = [tuple(range(24 * i, 24 * i + 24)) for i in range(len(lens))]
for runner in (eager, graphed):                        # prefills: eager on both
    assert not graphs.serves(prompts, tables, None)
    runner.forward(prompts, [0] * len(lens), tables)
starts = list(lens)
served = 0
# decodes (1 row each), verify passes (1 + up to 3 drafts, padded to 4 rows), mixed
for step, (batch, rows) in enumerate([([0, 1, 2], [1] * 3), ([0, 1, 2, 3, 4], [1] * 5),
                                      ([3], [4]), ([0, 4], [2, 1]), ([0, 1, 2, 3], [3, 1, 4, 2]),
                                      ([4, 1], [1, 1])]):
    tokens = [tuple(torch.randint(0, 300, (n,), generator=g).tolist()) for n in rows]
    pos, tabs = [starts[i] for i in batch], [tables[i] for i in batch]
    assert graphs.serves(tokens, tabs, None)
    want = eager.forward(tokens, pos, tabs)
    got = graphed.forward(tokens, pos, tabs)
    served += 1
    assert got.shape == want.shape
    # bitwise: the same kernels, and the eager split boundaries (64 tokens at these lengths)
    # are the graphs' too; the graphs' extra splits are empty and merge away exactly
    assert torch.equal(got, want), (step, (got - want).abs().max().item())
    for i, n in zip(batch, rows):
        starts[i] += n
    real = blocks * bs                                  # every block a pool hands out
    assert torch.equal(graph_cache.k[:, :real], eager_cache.k[:, :real]), step
    assert torch.equal(graph_cache.v[:, :real], eager_cache.v[:, :real]), step
pad = graph_cache.padding_block * bs
# padded rows wrote their own slot: in layer 0, from the padding token alone (the later layers'
# values there come from a padded verify row's unwritten attention parts: anything, NaN too)
assert graph_cache.k[0, pad].abs().sum() > 0
# not served: more rows than captured, a layer subset, more requests than the largest size, a
# wider table
assert not graphs.serves([(1, 2, 3, 4, 5)], [tables[0]], None)
assert not graphs.serves([(1,)], [tables[0]], [0])
assert not graphs.serves([(1,)] * 9, [tables[0]] * 9, None)
assert not graphs.serves([(1,)], [tuple(range(129))], None)
print("ok graphs", served)
'''


@pytest.mark.parametrize("min_split", [1024, 64])
def test_static_body_matches_eager_forward(min_split, triton_interpreted):
    triton_interpreted(CHILD, "ok graphs 6", str(min_split))


def test_capture_shapes():
    assert query_lens(0) == [1] and query_lens(4) == [1, 5] and query_lens(40) == [1, 16]
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4] + list(range(8, 65, 8))


def test_enforce_eager_reaches_the_worker():
    args = build_parser().parse_args(["serve", "--enforce-eager"])
    config = engine_config(args)
    assert config.enforce_eager and config.worker_config().enforce_eager
    assert not EngineConfig().worker_config().enforce_eager
    assert EngineConfig(max_num_seqs=12).worker_config().max_num_seqs == 12


def test_no_graphs_on_a_cpu():
    from specserve.scheduler.engine import EngineCore
    core = EngineCore(EngineConfig(model="tiny-random", device="cpu", num_kv_blocks=16))
    assert core.worker.runner.graphs is None
    assert core.worker.storage.padding_block is None
    assert core.worker.storage.k.shape[1] == 16 * core.config.block_size


def test_graphs_only_where_the_kernel_tiles_the_heads():
    from specserve.kernels.triton.paged_attention import tiles
    assert tiles(16) and tiles(64) and tiles(128)
    assert not tiles(8) and not tiles(48) and not tiles(80)
