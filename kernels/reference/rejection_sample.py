"""Lossless acceptance of drafts by rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Per request b with m_b drafts d_1..d_m (padded to K), target distributions p_1..p_{m+1} and draft
distributions q_1..q_m (one-hot when the drafter is deterministic):
  1. accept d_i while u_i * q_i(d_i) <= p_i(d_i)          (probability min(1, p/q))
  2. at the first rejection i emit a token from max(p_i - q_i, 0) (normalised), drop the rest;
  3. if all m are accepted, emit a bonus token from p_{m+1}.
Every emitted token is then distributed exactly as the target samples. The token at the stop row is
drawn by the exponential race argmax(w / E), E ~ Exp(1), which samples w / sum(w) without
normalising. The caller draws `uniforms` and `noise` for every request whatever happens, so a seeded
request consumes the same randomness in any batch.

Chunks (verification frontiers): calling this on positions [lo, hi) of a request whose drafts before
lo were all accepted, with target rows lo..hi, uniforms[lo:hi] and the same noise, decides exactly
what one call over all positions decides: acceptance is a prefix, and rows after the first rejection
never influence the result. A missing stop row (hi not computed yet) may be zeros when the caller
discards the stop token of a chunk that was accepted in full.
"""
from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs: [B, K + 1, V]; draft_token_ids: [B, K] (padding ignored); num_drafts: [B];
    draft_probs: [B, K, V] or None (one-hot drafts); uniforms: [B, K] in (0, 1]; noise: [B, V] > 0.

    Returns (token_ids [B, K + 1] padded with -1, num_accepted [B]); request b emits
    token_ids[b, :num_accepted[b] + 1]."""
    batch, k_max = draft_token_ids.shape
    dev = target_probs.device
    pos = torch.arange(k_max, device=dev)[None, :]                          # [1, K]
    valid = pos < num_drafts[:, None]
    drafts = draft_token_ids.clamp_min(0)
    p_draft = target_probs[:, :k_max].gather(2, drafts[..., None])[..., 0]  # [B, K]
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else draft_probs.gather(2, drafts[..., None])[..., 0])
    accepted = (uniforms * q_draft <= p_draft) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)                # [B]

    rows = torch.arange(batch, device=dev)
    p_stop = target_probs[rows, num_accepted]                              # [B, V]
    rejected = num_accepted < num_drafts                                    # else: bonus row
    stop_at = num_accepted.clamp_max(max(k_max - 1, 0))
    if draft_probs is None:
        q_stop = torch.zeros_like(p_stop)
        if k_max:
            q_stop[rows, drafts[rows, stop_at]] = 1.0
    else:
        q_stop = draft_probs[rows, stop_at] if k_max else torch.zeros_like(p_stop)
    weights = torch.where(rejected[:, None], (p_stop - q_stop).clamp_min(0), p_stop)
    stop_token = (weights / noise).argmax(dim=1)                            # [B]

    out = torch.full((batch, k_max + 1), -1, dtype=torch.long, device=dev)
    keep = pos < num_accepted[:, None]
    out[:, :k_max] = torch.where(keep, draft_token_ids, out[:, :k_max])
    out[rows, num_accepted] = stop_token
    return out, num_accepted
