"""Llama-family decoder in plain PyTorch (SmolLM2, Llama 3, Qwen2-style QKV bias optional).

The model never owns a KV cache. Each layer hands its post-RoPE keys/values to an attention object
(`attn(layer_idx, q, k, v) -> out`) built per step: the paged cache (runner), the compressed
drafting cache (lossy_kv), a dense cache (calibration). So one model serves every phase.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class Attention(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (post-RoPE). Stores k/v for the new tokens wherever this phase keeps them and returns
        [num_tokens, num_heads, head_dim]: each token attends causally to its request's context."""
        ...


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight_f32).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight_f32: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add, then RMSNorm: -> (x + delta, norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight_f32, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] -> x rotated (queries and keys go through in one call)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._weight_f32: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self._float_weight(), self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
        """-> (x + delta, norm(x + delta)); delta None: (x, norm(x))."""
        if delta is None:
            return x, self(x)
        return add_rms_norm(x, delta, self._float_weight(), self.eps)

    def _float_weight(self) -> torch.Tensor:
        """The weight in float32, cast once (not once per call: a kernel launch per layer on
        GPU)."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._weight_f32 is None or self._weight_f32[0] != key:
            self._weight_f32 = (key, w.detach().float())
        return self._weight_f32[1]


class RotaryEmbedding(nn.Module):
    """HF convention (rotate_half); llama.cpp's interleaved Q/K rows are un-permuted at load
    time."""

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        # [max_position, head_dim/2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim/2] for this step's positions: gathered once per
        forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """oneDNN can run prepacked GEMMs in `dtype` on this CPU (bf16: AVX512-BF16 or AMX)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 or bf16 [out, in] weight reordered into oneDNN's blocked layout (an opaque mkldnn
    tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that, once `pack()`ed, runs oneDNN's GEMM on a prepacked fp32 or bf16 weight (CPU
    only). At the 1-144 row shapes of decode, drafting and verification a model forward on MKL's
    sgemm is 1.6-2.4x slower on the benchmark CPU, and its rows depend on how many rows share the
    call; the packed GEMM's rows mostly do not (`benchmarks/cpu_gemm.py`). Unpacked bf16 F.linear
    is no faster than fp32; packed bf16 reads half the bytes. The dense weight stays for
    state_dict and loading."""
    packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Pack the weight and drop the dense copy (nothing reads it once packed), so the weights
        are held once."""
        self.packed = pack_cpu_weight(self.weight)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed, self.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor],
                attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: the previous layer's MLP output, not yet added (the add is
        done by this layer's `add_forward`). Returns (residual stream, this layer's MLP output)."""
        num_tokens = x.shape[0]
        x, h = self.input_layernorm.add_forward(x, delta)
        qkv = self.qkv_proj(h)
        # q and k sit side by side in qkv: rotate them as one [num_tokens, heads + kv_heads, D]
        # tensor
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens,
                                                      self.num_heads + self.num_kv_heads,
                                                       self.head_dim)
        q, k = apply_rope(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        o = attn(self.layer_idx, q, k, v)                 # [num_tokens, num_heads, head_dim]
        x, h = self.post_attention_layernorm.add_forward(
            x, self.o_proj(o.reshape(num_tokens, self.q_size)))
        return x, self.down_proj(silu_mul(self.gate_up_proj(h)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size,
                                                                      cfg.vocab_size,
                                                                       bias=False)
        self._lm_head_packed: torch.Tensor | None = None     # set by pack_for_cpu

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                layers: list[int] | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (packed over requests). Returns the final-norm hidden
        states [num_tokens, hidden]. `layers` runs only those layers (self-speculation skips
        some)."""
        x, delta = self.embed_tokens(input_ids), None
        rope = self.rope.table(positions)
        for i in (range(len(self.layers)) if layers is None else layers):
            x, delta = self.layers[i](x, delta, rope, attn)
        return self.norm.add_forward(x, delta)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._lm_head_packed is not None:
            return packed_linear(hidden, self._lm_head_packed, None).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()          # [num_rows, vocab]

    def pack_for_cpu(self) -> bool:
        """Prepack every linear layer and the LM head for oneDNN (fp32 or bf16 on CPU; see
        `Linear`). Linear layers then hold only the packed weight; the LM head is a second copy
        (the embedding keeps its dense one for lookups). Returns False (and changes nothing)
        where unsupported."""
        weight = self.embed_tokens.weight
        if weight.device.type != "cpu" or not cpu_packing_available(weight.dtype):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        head = weight if self.lm_head is None else self.lm_head.weight
        self._lm_head_packed = pack_cpu_weight(head)
        return True
