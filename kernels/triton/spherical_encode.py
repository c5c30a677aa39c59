"""Spherical-KV key encoder (Triton): one program per (kv head, page); same contract as the reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _encode_kernel(k_ptr, cb_ptr, theta_ptr, radius_ptr, scale_ptr, T, NUM_PAGES,
                   D: tl.constexpr, G: tl.constexpr, K: tl.constexpr, GS: tl.constexpr, P: tl.constexpr):
    pid = tl.program_id(0)
    head = pid // NUM_PAGES
    page = pid % NUM_PAGES
    offs_t = page * P + tl.arange(0, P)                                   # [P] token index
    offs_i = tl.arange(0, GS)                                             # [g] dim within group
    offs_c = tl.arange(0, K)                                              # [K] codeword
    for j in tl.static_range(G):
        kj = tl.load(k_ptr + head * T * D + offs_t[:, None] * D + j * GS + offs_i[None, :]).to(tl.float32)
        cb = tl.load(cb_ptr + ((head * G + j) * K + offs_c[:, None]) * GS + offs_i[None, :]).to(tl.float32)
        dots = tl.sum(kj[:, None, :] * cb[None, :, :], axis=2)             # [P, K]
        theta = tl.argmax(dots, axis=1)                                   # [P]
        r = tl.sqrt(tl.sum(kj * kj, axis=1))                              # [P]
        s = tl.maximum(tl.max(r, axis=0), 1e-12)
        code = tl.floor(r / s * 255.0 + 0.5)
        code = tl.minimum(tl.maximum(code, 0.0), 255.0)
        out = head * T * G + offs_t * G + j
        tl.store(theta_ptr + out, theta.to(tl.uint8))
        tl.store(radius_ptr + out, code.to(tl.uint8))
        tl.store(scale_ptr + (head * NUM_PAGES + page) * G + j, s)


def spherical_encode(k: torch.Tensor, codebook: torch.Tensor, page_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k: [H, T, D]; codebook: [H, G, K, g] -> theta, radius [H, T, G] uint8; scale [H, T/page, G] f32."""
    num_heads, num_tokens, head_dim = k.shape
    _, num_groups, num_codes, group = codebook.shape
    assert num_groups * group == head_dim and num_tokens % page_size == 0
    num_pages = num_tokens // page_size
    k = k.float().contiguous()
    cb = codebook.float().contiguous()
    theta = torch.empty(num_heads, num_tokens, num_groups, dtype=torch.uint8, device=k.device)
    radius = torch.empty_like(theta)
    scale = torch.empty(num_heads, num_pages, num_groups, dtype=torch.float32, device=k.device)
    _encode_kernel[(num_heads * num_pages,)](k, cb, theta, radius, scale, num_tokens, num_pages,
                                             D=head_dim, G=num_groups, K=num_codes, GS=group, P=page_size)
    return theta, radius, scale
