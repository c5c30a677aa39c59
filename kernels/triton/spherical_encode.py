"""Spherical-KV key encoder (Triton): one program per (kv head, page, group); same contract as the
reference.

Each program loads its page's [P, g] slice of keys, scores it against the group's codebook with one
matrix product ([P, g] x [g, K], fp32 "ieee" so the argmax matches the reference's), and quantizes
the radii against the page's largest one. Codebooks smaller than 16 words are padded (tl.dot needs
16) and the padding masked out of the argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _encode_kernel(k_ptr, cb_ptr, theta_ptr, radius_ptr, scale_ptr, T, NUM_PAGES,
                   D: tl.constexpr, G: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                   GS: tl.constexpr,
                   P: tl.constexpr):
    head = tl.program_id(0)
    page = tl.program_id(1)
    j = tl.program_id(2)                                                  # group
    offs_t = page * P + tl.arange(0, P)                                   # [P] token index
    offs_i = tl.arange(0, GS)                                             # [g] dim within group
    offs_c = tl.arange(0, KP)                                             # [KP] codeword (padded)
    kj = tl.load(k_ptr + head * T * D + offs_t[:, None] * D + j * GS + offs_i[None,
                                                                              :]).to(tl.float32)
    cbt = tl.load(cb_ptr + ((head * G + j) * K + offs_c[None, :]) * GS + offs_i[:, None],
                  mask=offs_c[None, :] < K, other=0.0).to(tl.float32)     # [g, KP]
    dots = tl.dot(kj, cbt, input_precision="ieee")                        # [P, KP]
    dots = tl.where(offs_c[None, :] < K, dots, float("-inf"))
    theta = tl.argmax(dots, axis=1)                                       # [P]
    r = tl.sqrt(tl.sum(kj * kj, axis=1))                                  # [P]
    s = tl.maximum(tl.max(r, axis=0), 1e-12)
    code = tl.floor(r / s * 255.0 + 0.5)
    code = tl.minimum(tl.maximum(code, 0.0), 255.0)
    out = head * T * G + offs_t * G + j
    tl.store(theta_ptr + out, theta.to(tl.uint8))
    tl.store(radius_ptr + out, code.to(tl.uint8))
    tl.store(scale_ptr + (head * NUM_PAGES + page) * G + j, s)


def supports(k: torch.Tensor, codebook: torch.Tensor, page_size: int) -> bool:
    """Pages and codebook groups of at least 16 (tl.dot's smallest tile); smaller ones, as tests
    configure, go to the reference."""
    return page_size >= 16 and codebook.shape[-1] >= 16


def spherical_encode(k: torch.Tensor, codebook: torch.Tensor, page_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k: [H, T, D]; codebook: [H, G, K, g] -> theta, radius [H, T, G] uint8; scale [H, T/page, G]
    f32."""
    num_heads, num_tokens, head_dim = k.shape
    _, num_groups, num_codes, group = codebook.shape
    assert num_groups * group == head_dim and num_tokens % page_size == 0
    assert page_size >= 16 and group >= 16, "tl.dot needs 16 rows and a depth of 16"
    num_pages = num_tokens // page_size
    k = k.float().contiguous()
    cb = codebook.float().contiguous()
    theta = torch.empty(num_heads, num_tokens, num_groups, dtype=torch.uint8, device=k.device)
    radius = torch.empty_like(theta)
    scale = torch.empty(num_heads, num_pages, num_groups, dtype=torch.float32, device=k.device)
    if num_pages:
        _encode_kernel[(num_heads, num_pages, num_groups)](
            k, cb, theta, radius, scale, num_tokens, num_pages, D=head_dim, G=num_groups,
            K=num_codes,
            KP=max(16, triton.next_power_of_2(num_codes)), GS=group, P=page_size)
    return theta, radius, scale
