import torch

from specserve.kernels.dispatch import get_op
from specserve.kernels.metadata import PagedAttentionMetadata


def dense_attention(q, k, v, scale):
    """q: [Q, H, D] at the last Q positions of k/v: [L, Hkv, D]; plain causal softmax attention."""
    num_q, num_heads, _ = q.shape
    length, num_kv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(num_heads // num_kv, dim=1)
    v = v.repeat_interleave(num_heads // num_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(length - num_q, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_mixed_batch_matches_dense_attention_per_request():
    torch.manual_seed(0)
    block_size, num_blocks, num_heads, num_kv, dim = 4, 64, 4, 2, 8
    k_cache = torch.randn(num_blocks * block_size, num_kv, dim)
    v_cache = torch.randn(num_blocks * block_size, num_kv, dim)
    # (context length, new queries): a decode, verify rows, a first prefill chunk, a later chunk,
    # a length on a block boundary and one just past it, a whole prompt ending mid-block (its last
    # block's
    # unused slots are gathered too and must stay invisible)
    shapes = [(9, 1), (13, 4), (20, 20), (37, 17), (16, 1), (17, 3), (22, 22)]
    perm = torch.randperm(num_blocks).tolist()
    tables, query_start, q_parts, used = [], [0], [], 0
    for length, num_q in shapes:
        nb = -(-length // block_size)
        tables.append(perm[used:used + nb])
        used += nb
        q_parts.append(torch.randn(num_q, num_heads, dim))
        query_start.append(query_start[-1] + num_q)
    q = torch.cat(q_parts)
    meta = PagedAttentionMetadata(query_start, [s[0] for s in shapes], tables, block_size)
    out = get_op("paged_attention", "cpu")(q, k_cache, v_cache, meta, dim ** -0.5)
    for b, (length, num_q) in enumerate(shapes):
        slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size
                              for p in range(length)])
        want = dense_attention(q_parts[b], k_cache[slots], v_cache[slots], dim ** -0.5)
        got = out[query_start[b]:query_start[b + 1]]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
