"""Dense attention in fp32, the shared reference: one sequence (`dense_attention`, with an optional
causal mask by position), one query per sequence over padded keys (`batched_attention`), and the
exact log-sum-exp merge of attention over disjoint key sets (`merge_attention`).

Every function returns (out, lse) so parts computed over different key sets (dense sinks and tail,
compressed pages, a draft round's own keys) merge exactly. Shapes: queries [num_q, num_heads, D];
query head h reads kv head h // (num_heads // num_kv_heads).
"""
from __future__ import annotations

import math

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                    q_positions: torch.Tensor | None = None,
                    k_positions: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain GQA attention -> (out [num_q, num_heads, D], lse [num_q, num_heads]), fp32.

    q: [num_q, num_heads, D]; k, v: [n, num_kv_heads, D]. With positions, key j is visible to
    query i only if k_positions[j] <= q_positions[i] (and, with a sliding `window`, >
    q_positions[i] - window). `softcap` > 0 soft-caps the scores (Gemma 2). A query that sees
    nothing gets out 0, lse -inf.
    """
    num_q, num_heads, _ = q.shape
    n, num_kv_heads, _ = k.shape
    if n == 0:
        return (q.new_zeros(q.shape, dtype=torch.float32),
                q.new_full((num_q, num_heads), -math.inf, dtype=torch.float32))
    group = num_heads // num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1)                     # [n, num_heads, D]
    vf = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale    # [num_heads, num_q, n]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if q_positions is not None:
        visible = k_positions[None, :] <= q_positions[:, None]          # [num_q, n]
        if window:
            visible &= k_positions[None, :] > q_positions[:, None] - window
        logits = logits.masked_fill(~visible[None], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)                               # [num_heads, num_q]
    probs = torch.exp(logits - lse[..., None].clamp_min(-1e30)).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, lse.transpose(0, 1).contiguous()


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key sets: softmax weights renormalised by lse.

    parts: (out [num_q, num_heads, D], lse [num_q, num_heads]) each; lse -inf parts add nothing.
    """
    lses = torch.stack([lse for _, lse in parts])                       # [P, num_q, num_heads]
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse.clamp_min(-1e30)[None]).nan_to_num(0.0)
    out = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts))
    return out, lse


def batched_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                      valid: torch.Tensor | None = None,
                      softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over that sequence's padded keys, all sequences in one call (fp32).

    q [R, num_heads, D]; k, v [R, num_kv_heads, n, D] (head-major: two batched matmuls, no copies
    of strided views); valid [R, n] bool (None: all keys visible); `softcap` > 0 soft-caps the
    scores.
    -> (out [R, num_heads, D], lse [R, num_heads]); a row that sees nothing gets out 0, lse -inf.
    """
    num_rows, num_heads, d = q.shape
    num_kv_heads, n = k.shape[1], k.shape[2]
    if n == 0:
        return (q.new_zeros(q.shape, dtype=torch.float32),
                q.new_full((num_rows, num_heads), -math.inf, dtype=torch.float32))
    qg = q.float().reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, d)
    logits = torch.matmul(qg, k.float().transpose(-1, -2)) * sm_scale    # [R, kvh, group, n]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)                                 # [R, kvh, group]
    probs = torch.exp(logits - lse[..., None].clamp_min(-1e30)).nan_to_num(0.0)
    out = torch.matmul(probs, v.float())                                  # [R, kvh, group, D]
    return out.reshape(num_rows, num_heads, d), lse.reshape(num_rows, num_heads)
