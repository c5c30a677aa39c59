"""The decoder stack on the CPU's C kernels with a step's buffers allocated once: one raw kernel
call per op, where `LlamaModel.forward` goes through modules, dispatch and per-op allocation
("Python and dispatch" in `benchmarks/profile_step.py`, docs/BENCHMARKS.md §9.6-9.7).

It calls the same kernels on the same inputs in the same order as the modules do, so its hidden
states are bitwise theirs (tests/spec_phases/test_cpu_decoder.py), whichever path a step takes.
It serves the layer shape most checkpoints have (Llama, Mistral, Qwen2: no q/k norms, no sandwich
norms, SwiGLU, one RoPE) once every linear is packed for the C kernel (`LlamaModel.pack_for_cpu`)
and the kernels built; the runner takes it for steps over the paged cache in device memory
(`spec_phases/runner.py`), the modules serve everything else.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specserve.kernels.cpu import linear as cpu_linear
from specserve.kernels.cpu import paged_attention as cpu_attention
from specserve.kernels.cpu import rms_norm as cpu_norm
from specserve.kernels.cpu import rope as cpu_rope
from specserve.kernels.cpu.native import BuildError, library
from specserve.kernels.metadata import LayerAttention, PagedAttentionMetadata
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.model import DecoderLayer, LlamaModel


def supported(model: LlamaModel) -> bool:
    """Every layer has the plain shape, every linear runs the C kernel, the kernels build."""
    cfg = model.config
    if cfg.local_rope is not None or model.embed_tokens.weight.dtype != torch.float32:
        return False
    for layer in model.layers:
        if (layer.q_norm is not None or layer.attn_out_norm is not None
                or layer.mlp_out_norm is not None or layer.query_scale != 1.0
                or layer.activation != "silu"):
            return False
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if linear.packed is None or linear.packed.onednn:
                return False
    try:
        for kernel in ("rms_norm", "rope", "paged_attention"):
            library(kernel)
    except BuildError:
        return False
    return True


class CpuDecoder:
    """`LlamaModel.forward` for a model `supported` says it serves, over a `KVStorage`."""

    def __init__(self, model: LlamaModel):
        self.model = model
        cfg = model.config
        self.hidden, self.head_dim = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.q_size = cfg.num_heads * cfg.head_dim
        self.qkv_size = self.q_size + 2 * cfg.num_kv_heads * cfg.head_dim
        self.intermediate = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps

    @staticmethod
    def enabled() -> bool:
        """SPECSERVE_KERNELS=reference / triton ask for the module path (its ops' choice)."""
        return os.environ.get("SPECSERVE_KERNELS", "auto") == "auto"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, storage: KVStorage,
                meta: PagedAttentionMetadata, slot_mapping: torch.Tensor,
                attention: LayerAttention, layers: list[int] | None = None) -> torch.Tensor:
        """As `LlamaModel.forward` with `runner.PagedAttention`: final-norm hidden states."""
        model, n = self.model, input_ids.shape[0]
        x = model.embed(input_ids).contiguous()             # the residual stream, updated in place
        cos, sin = model.ropes[0].table(positions)
        cos, sin = cos.reshape(n, self.head_dim), sin.reshape(n, self.head_dim)
        h = torch.empty(n, self.hidden)
        qkv = torch.empty(n, self.qkv_size)
        qk = torch.empty(n, self.num_heads + self.num_kv_heads, self.head_dim)
        out = torch.empty(n, self.hidden)                  # o_proj's, then down_proj's output
        gate_up = torch.empty(n, 2 * self.intermediate)
        act = torch.empty(n, self.intermediate)
        qk_in = qkv[:, :self.q_size + self.num_kv_heads * self.head_dim].view(
            n, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.num_kv_heads * self.head_dim:].view(
            n, self.num_kv_heads, self.head_dim)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        gate, up = gate_up[:, :self.intermediate], gate_up[:, self.intermediate:]
        delta = None
        for i in (range(len(model.layers)) if layers is None else layers):
            layer: DecoderLayer = model.layers[i]
            cpu_norm.add_rms_norm_into(x, delta, layer.input_layernorm._float_weight(), self.eps,
                                       h)
            cpu_linear.linear_into(h, layer.qkv_proj.packed, layer.qkv_proj.bias, qkv)
            cpu_rope.rope_into(qk_in, cos, sin, qk)
            storage.write(i, slot_mapping, k, v)
            o = cpu_attention.paged_attention(q, storage.k[i], storage.v[i], meta,
                                              **attention.options(i))
            cpu_linear.linear_into(o.view(n, self.q_size), layer.o_proj.packed, None, out)
            cpu_norm.add_rms_norm_into(x, out, layer.post_attention_layernorm._float_weight(),
                                       self.eps, h)
            cpu_linear.linear_into(h, layer.gate_up_proj.packed, None, gate_up)
            torch.mul(F.silu(gate), up, out=act)
            cpu_linear.linear_into(act, layer.down_proj.packed, None, out)
            delta = out
        if delta is None:
            return model.norm(x)
        cpu_norm.add_rms_norm_into(x, delta, model.norm._float_weight(), self.eps, h)
        return h
