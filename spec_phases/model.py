"""The decoder in plain PyTorch: one Llama-shaped model for every supported family (Llama 2/3,
Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3, Phi-3). What sets a family apart is declared in
`FamilyOptions` (derived from the checkpoint's config in `spec_phases/families.py`), and the layer
reads those options: no per-family model classes.

The model never owns a KV cache. Each layer hands its post-RoPE keys/values to an attention object
(`attn(layer_idx, q, k, v) -> out`) built per step: the paged cache (runner), the compressed
drafting cache (lossy_kv), a dense cache (calibration). So one model serves every phase. A family's
query scaling (`query_pre_attn_scalar`) is folded into q here, so every attention implementation
scales scores by head_dim ** -0.5; sliding windows and score soft-capping are per-layer facts of
the config that every full-model attention reads from `ModelConfig.attention()` (the runner's paged
attention, calibration's dense caches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.cpu import linear as cpu_linear
from specserve.kernels.cpu.linear import PackedWeight
from specserve.kernels.dispatch import get_op
from specserve.kernels.metadata import LayerAttention
from specserve.spec_phases.rope import RopeConfig, frequencies

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@dataclass(frozen=True)
class FamilyOptions:
    """What sets a family's decoder apart from Llama's (the defaults are Llama)."""
    norm_offset: float = 0.0             # Gemma: RMSNorm scales by (1 + w)
    scale_embeddings: bool = False       # Gemma: embeddings times sqrt(hidden_size)
    activation: str = "silu"             # the MLP's gate: silu (SwiGLU), gelu_tanh / gelu (GeGLU)
    qk_norm: bool = False                # Qwen3, Gemma 3: RMSNorm over each head of q and k
    sandwich_norms: bool = False         # Gemma 2/3: RMSNorm on the attention and MLP outputs
    query_pre_attn_scalar: float | None = None   # Gemma: scores scaled by this ** -0.5
    attn_softcap: float = 0.0            # Gemma 2: scores -> cap * tanh(scores / cap); 0: off
    final_softcap: float = 0.0           # Gemma 2: logits -> cap * tanh(logits / cap); 0: off

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig = RopeConfig()
    local_rope: RopeConfig | None = None     # sliding-window layers' RoPE where it differs
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # per layer: a sliding window of this many keys (the query's own included), 0 = full
    # attention; () = every layer full
    windows: tuple[int, ...] = ()
    family: FamilyOptions = FamilyOptions()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"windows must name every layer ({self.num_layers}), got "
                             f"{len(self.windows)}")

    def layer_window(self, layer: int) -> int:
        """Keys layer `layer` attends to: the last this many positions (query's own included);
        0: all of them."""
        return self.windows[layer] if self.windows else 0

    def attention(self) -> LayerAttention:
        """What every attention implementation needs to know of this model: the score scale
        (the family's query scaling is folded into q), each layer's window, the score soft-cap."""
        return LayerAttention(self.head_dim ** -0.5,
                              tuple(self.layer_window(i) for i in range(self.num_layers)),
                              self.family.attn_softcap)

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
    """In float32, as transformers computes it (`kernels/reference/rms_norm.py`; one C call on
    CPU, `kernels/cpu/rms_norm.py`)."""
    return get_op("rms_norm", x.device.type)(x, weight_f32, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight_f32: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add, then RMSNorm: -> (x + delta, norm(x + delta))."""
    return get_op("add_rms_norm", x.device.type)(x, delta, weight_f32, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] -> x rotated (queries and keys go through in one call).
    cos, sin: [num_tokens, 1, head_dim], each half repeated (`RotaryEmbedding.table`):
    transformers' x * cos + rotate_half(x) * sin, in float32 (`kernels/reference/rope.py`; one C
    call on CPU, `kernels/cpu/rope.py`)."""
    return get_op("rope", x.device.type)(x, cos, sin)


def gated_mlp_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up: SwiGLU (silu) or GeGLU (gelu, exact or its tanh approximation). silu and
    gelu_tanh are ops (one C call on CPU, `kernels/cpu/activation.c`, the one the C decoder runs);
    exact gelu is torch's."""
    if activation in ("silu", "gelu_tanh"):
        return get_op(f"{activation}_mul", gate_up.device.type)(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class RMSNorm(nn.Module):
    """RMSNorm scaling by `weight + offset` (offset 1: Gemma's (1 + w) norms), in float32."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset
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
        """The weight (plus offset) in float32, computed once (not once per call: a kernel launch
        per layer on GPU)."""
        w = self.weight
        if w.dtype == torch.float32 and not self.offset:
            return w
        key = (w.data_ptr(), w._version)
        if self._weight_f32 is None or self._weight_f32[0] != key:
            self._weight_f32 = (key, w.detach().float() + self.offset)
        return self._weight_f32[1]


class RotaryEmbedding(nn.Module):
    """HF convention (rotate_half); llama.cpp's interleaved Q/K rows are un-permuted at load
    time. Frequencies and the attention factor from `spec_phases/rope.py`."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig):
        super().__init__()
        inv_freq, attention_factor = frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        # [max_position, head_dim/2]
        self.register_buffer("cos", (freqs.cos() * attention_factor).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).float(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim] (each half repeated, as `apply_rope` reads them) for
        this step's positions: gathered once per forward."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)


def pack_weight(weight: torch.Tensor, gguf_blocks: tuple | None, int8: bool = False
                ) -> PackedWeight:
    """A weight packed for the CPU: from its GGUF blocks where the loader kept them, the C kernel
    runs and a form of it reads their type (`int8`: summed on int8 dot products against per-row
    quantized activations), else from the dense weight (`kernels/cpu/linear.py`). gguf_blocks:
    (GGUF type, blocks), or ("mixed", [(type, blocks), ...]) for a fused weight whose parts
    differ in type."""
    if (gguf_blocks is not None and weight.dtype == torch.float32
            and cpu_linear.c_kernel_available()):
        kind, blocks = gguf_blocks
        packed = (cpu_linear.pack_gguf_parts(blocks, weight.shape[1], int8) if kind == "mixed"
                  else cpu_linear.pack_gguf(kind, blocks, weight.shape[1], int8))
        if packed is not None:
            return packed
    return cpu_linear.pack(weight)


class Linear(nn.Linear):
    """nn.Linear that, once `pack()`ed, runs on a weight packed once for the CPU
    (`kernels/cpu/linear.py`: the C kernel for fp32, whose rows do not depend on how many rows
    share the call; oneDNN's prepacked GEMM for bf16). At the 1-144 row shapes of decode, drafting
    and verification MKL's sgemm (plain F.linear) is 1.6-2.4x slower, and unpacked bf16 F.linear
    is no faster than fp32 (`benchmarks/cpu_gemm.py`)."""
    packed: PackedWeight | None = None
    # the checkpoint's GGUF blocks of this weight (set by the loader, float32 on CPU;
    # `pack_weight`): packed quantized where the C kernel runs
    gguf_blocks: tuple | None = None

    def pack(self, int8: bool = False) -> None:
        """Pack the weight (its GGUF blocks where it has them; `int8`: see `pack_weight`) and drop
        the dense copy (nothing reads it once packed), so the weights are held once."""
        self.packed = pack_weight(self.weight, self.gguf_blocks, int8)
        self.gguf_blocks = None
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return cpu_linear.linear(x, self.packed, self.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        fam = cfg.family
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.activation = fam.activation
        # Gemma 3's sliding layers rotate with their own base
        self.rope_index = int(cfg.local_rope is not None and cfg.layer_window(layer_idx) > 0)
        # the family's score scale folded into q (attention scales by head_dim ** -0.5)
        self.query_scale = (1.0 if fam.query_pre_attn_scalar is None
                            else (cfg.head_dim / fam.query_pre_attn_scalar) ** 0.5)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        norm = lambda dim: RMSNorm(dim, cfg.rms_norm_eps, fam.norm_offset)  # noqa: E731
        self.input_layernorm = norm(cfg.hidden_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.q_norm = norm(cfg.head_dim) if fam.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if fam.qk_norm else None
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.attn_out_norm = norm(cfg.hidden_size) if fam.sandwich_norms else None
        # the norm before the MLP (HF: Llama's post_attention_layernorm, Gemma's
        # pre_feedforward_layernorm)
        self.post_attention_layernorm = norm(cfg.hidden_size)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.mlp_out_norm = norm(cfg.hidden_size) if fam.sandwich_norms else None

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None,
                ropes: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                attn: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: the previous layer's MLP output, not yet added (the add is
        done by this layer's `add_forward`). ropes: (cos, sin) per RoPE the model has
        (`LlamaModel.rope_tables`). Returns (residual stream, this layer's MLP output)."""
        num_tokens = x.shape[0]
        x, h = self.input_layernorm.add_forward(x, delta)
        qkv = self.qkv_proj(h)
        # q and k sit side by side in qkv: rotate them as one [num_tokens, heads + kv_heads, D]
        # tensor
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens,
                                                      self.num_heads + self.num_kv_heads,
                                                      self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = apply_rope(qk, *ropes[self.rope_index]).split([self.num_heads, self.num_kv_heads],
                                                             dim=1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        o = attn(self.layer_idx, q, k, v)                 # [num_tokens, num_heads, head_dim]
        o = self.o_proj(o.reshape(num_tokens, self.q_size))
        if self.attn_out_norm is not None:
            o = self.attn_out_norm(o)
        x, h = self.post_attention_layernorm.add_forward(x, o)
        out = self.down_proj(gated_mlp_activation(self.gate_up_proj(h), self.activation))
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out)
        return x, out


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # no random init (the loader builds this on the meta device and assigns the checkpoint's
        # tensors): normal_ on meta imports torch._dynamo, 3.4 s of a start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size,
                                                                      cfg.vocab_size,
                                                                      bias=False)
        self._lm_head_packed: PackedWeight | None = None     # set by pack_for_cpu
        self._embedding_in_head = False        # tied, C-packed: lookups read the packed head
        # the head's GGUF blocks (the embedding's when tied): see `Linear`
        self.gguf_head: tuple | None = None
        # the RoPE tables come with `init_buffers`, once the weights are placed (computing them
        # on the meta device imports torch._dynamo: 3.4 s of a start)

    def init_buffers(self) -> None:
        """(Re)compute what is derived, not loaded: the RoPE tables (global, and the sliding
        layers' own where the family has one) and the embedding scale (Gemma: sqrt(hidden), in
        the weights' dtype as transformers rounds it). The loader calls this once it has assigned
        the checkpoint's tensors to a model built on the meta device."""
        cfg, device = self.config, self.embed_tokens.weight.device
        ropes = [cfg.rope] if cfg.local_rope is None else [cfg.rope, cfg.local_rope]
        self.ropes = nn.ModuleList(RotaryEmbedding(cfg.head_dim, cfg.max_position, r).to(device)
                                   for r in ropes)
        scale = cfg.hidden_size ** 0.5 if cfg.family.scale_embeddings else 1.0
        self.register_buffer("embed_scale", torch.tensor(scale, device=device), persistent=False)

    def rope_tables(self, positions: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                           ...]:
        """(cos, sin) of each RoPE for this step's positions, gathered once per forward."""
        return tuple(rope.table(positions) for rope in self.ropes)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embedding_in_head:
            x = cpu_linear.weight_rows(self._lm_head_packed, input_ids)
        else:
            x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype) if self.config.family.scale_embeddings else x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                layers: list[int] | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (packed over requests). Returns the final-norm hidden
        states [num_tokens, hidden]. `layers` runs only those layers (self-speculation skips
        some)."""
        x, delta = self.embed(input_ids), None
        ropes = self.rope_tables(positions)
        for i in (range(len(self.layers)) if layers is None else layers):
            x, delta = self.layers[i](x, delta, ropes, attn)
        return self.norm.add_forward(x, delta)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._lm_head_packed is not None:
            logits = cpu_linear.linear(hidden, self._lm_head_packed, None).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()     # [num_rows, vocab]
        cap = self.config.family.final_softcap
        return softcap(logits, cap) if cap else logits

    def pack_for_cpu(self, int8: bool = False) -> bool:
        """Pack every linear layer and the LM head for the CPU (`Linear`: the C kernel for fp32,
        oneDNN for bf16; `int8`: GGUF blocks on int8 dot products). Each then holds only its
        packed weight; a tied embedding reads its rows back from the C-packed head (oneDNN's
        layout is opaque: there the embedding keeps its dense copy). Returns False (and changes
        nothing) where unsupported."""
        weight = self.embed_tokens.weight
        if weight.device.type != "cpu" or not cpu_linear.packing_available(weight.dtype):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(int8)
        head = weight if self.lm_head is None else self.lm_head.weight
        self._lm_head_packed = pack_weight(head, self.gguf_head, int8)
        self.gguf_head = None
        if self.lm_head is not None:             # untied: the packed copy is its only reader
            self.lm_head.weight = nn.Parameter(head.new_empty(0), requires_grad=False)
        elif self._lm_head_packed.layout in cpu_linear.ROW_LAYOUTS:
            # tied: embedding lookups copy rows out of the packed head (exactly), so the vocab x
            # hidden matrix is held once (113 MB for SmolLM2 in fp32, 32 MB as Q8_0 panels)
            self._embedding_in_head = True
            self.embed_tokens.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        return True

    def packed_layouts(self) -> list[str | None]:
        """Every linear layer's and the LM head's packed layout (None: not packed)."""
        linears = [m.packed for m in self.modules() if isinstance(m, Linear)]
        return [None if p is None else p.layout for p in [*linears, self._lm_head_packed]]

    def drop_gguf_blocks(self) -> None:
        """Forget the GGUF blocks the loader kept (the weights are not packed: nothing reads
        them)."""
        self.gguf_head = None
        for module in self.modules():
            if isinstance(module, Linear):
                module.gguf_blocks = None

    def bytes_per_step(self) -> int:
        """The weight bytes one forward reads: every linear's (packed or dense) and the LM head
        once (an untied embedding is only looked up, row by row)."""
        total = 0
        for name, p in self.named_parameters():
            if name != "embed_tokens.weight" or self.lm_head is None:
                total += p.numel() * p.element_size()
        for module in self.modules():
            if isinstance(module, Linear) and module.packed is not None:
                total += module.packed.data.nbytes
        if self._lm_head_packed is not None:
            total += self._lm_head_packed.data.nbytes
        return total
