"""Spherical-KV key encoder (reference): grouped spherical VQ with 8-bit per-page radii.

A key of head_dim D is split into G = D / g groups of g dims. Group j of token t is stored as
    theta[t, j]  = argmax_c <k_j, C_j[c]>            (nearest unit codeword = nearest direction)
    radius[t, j] = round(|k_j| / scale[page, j] * 255)   8-bit, scale = largest |k_j| in the page
so that k_j ≈ radius / 255 * scale * C_j[theta].
"""
from __future__ import annotations

import torch


def group_norms(kg: torch.Tensor) -> torch.Tensor:
    """|k_j| as sqrt(sum of squares), written out so the kernel can match it bit for bit."""
    return (kg * kg).sum(-1).sqrt()


def spherical_encode(k: torch.Tensor, codebook: torch.Tensor, page_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k: [H, T, D] keys of whole pages (T % page_size == 0); codebook: [H, G, K, g] unit codewords.

    Returns theta [H, T, G] uint8, radius [H, T, G] uint8, scale [H, T // page_size, G] float32.
    """
    num_heads, num_tokens, head_dim = k.shape
    _, num_groups, _, group = codebook.shape
    assert num_groups * group == head_dim and num_tokens % page_size == 0
    kg = k.float().reshape(num_heads, num_tokens, num_groups, group)          # [H, T, G, g]
    dots = torch.einsum("htgi,hgki->htgk", kg, codebook.float())              # [H, T, G, K]
    theta = dots.argmax(-1).to(torch.uint8)
    r = group_norms(kg)                                                       # [H, T, G]
    num_pages = num_tokens // page_size
    scale = r.reshape(num_heads, num_pages, page_size, num_groups).amax(2).clamp_min(1e-12)
    scale_t = scale.repeat_interleave(page_size, dim=1)                       # [H, T, G]
    radius = torch.floor(r / scale_t * 255.0 + 0.5).clamp(0, 255).to(torch.uint8)
    return theta, radius, scale


def spherical_decode(theta: torch.Tensor, radius: torch.Tensor, scale: torch.Tensor,
                     codebook: torch.Tensor, page_size: int) -> torch.Tensor:
    """Inverse of the encoder up to quantization: -> keys [H, T, D] float32."""
    num_heads, num_tokens, num_groups = theta.shape
    idx = theta.long()[..., None].expand(-1, -1, -1, codebook.shape[-1])       # [H, T, G, g]
    words = torch.gather(codebook.float()[:, None].expand(-1, num_tokens, -1, -1, -1), 3,
                         idx[:, :, :, None]).squeeze(3)                        # [H, T, G, g]
    r = radius.float() / 255.0 * scale.repeat_interleave(page_size, dim=1)    # [H, T, G]
    return (r[..., None] * words).reshape(num_heads, num_tokens, -1)
