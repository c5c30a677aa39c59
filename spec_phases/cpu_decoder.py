"""The decoder stack on the CPU's C kernels in one call of `kernels/cpu/decoder.c` per step, with
the step's buffers allocated once, where `LlamaModel.forward` goes through modules, dispatch and
per-op allocation. The call runs the same kernels on the same inputs in the same order as the
modules do (each module's CPU op is one of these kernels), so the hidden states are bitwise
theirs (tests/spec_phases/test_cpu_decoder.py). Every query of a step goes through the C paged
attention (decodes and verify rows as they are, prompt chunks in tiles: `paged_attention.c`).

`decoder.c` runs `DecoderLayer.forward` op for op, each layer's ops read from a struct built once
from the model (`_structs`): every family's layer (Llama, Mistral, Qwen2, Phi-3; Qwen3's and
Gemma 3's per-head q/k norms; Gemma's (1 + w) norms, sandwich norms, query scale, GeGLU, score
soft-cap and Gemma 3's second RoPE). `unsupported` is the one accept-list: a float32 model whose
every linear is packed for the C kernel (`LlamaModel.pack_for_cpu`), the kernels built; the runner
takes it for steps over the paged cache in device memory
(`spec_phases/runner.py`), the modules serve everything else. The cache holds float32, or with
`--kv-cache-dtype bfloat16` / `fp8` bfloat16 or fp8 e4m3 (CACHE_DTYPES): the one call rounds K/V
to them as `KVStorage.write` (torch) does and the attention widens them back exactly, so both
paths still agree bit for bit.
"""
from __future__ import annotations

import ctypes
import os

import torch

from specserve.kernels.cpu import activation as cpu_activation
from specserve.kernels.cpu import decoder as fused
from specserve.kernels.cpu import linear as cpu_linear
from specserve.kernels.cpu import paged_attention as cpu_attention
from specserve.kernels.cpu.native import BuildError, library
from specserve.kernels.metadata import LayerAttention, PagedAttentionMetadata
from specserve.kv_cache.storage import KVStorage
from specserve.spec_phases.model import LlamaModel

CACHE_DTYPES = fused.CACHE_DTYPES           # the K/V cache's element types it reads and writes


def supported(model: LlamaModel) -> bool:
    return unsupported(model) is None


def unsupported(model: LlamaModel) -> str | None:
    """Why the one-call decoder cannot serve `model` (None: it can). It accepts every family's
    layer (`DecoderLayer`: per-head q/k norms, sandwich norms, a query scale, a second RoPE for
    the sliding layers, score soft-caps) in float32 (the modules' residual stream in the model's
    dtype: a bf16 model's is bf16, not the C decoder's float32), with an activation the C
    activation kernel has (SwiGLU, GeGLU's tanh form: not exact GeLU), every linear on the C
    kernel, and the kernels built with the ABI they mirror."""
    if model.embed_tokens.weight.dtype != torch.float32:
        return f"{model.embed_tokens.weight.dtype} embeddings"
    for layer in model.layers:
        if layer.activation not in cpu_activation.ACTIVATIONS:
            return f"the {layer.activation} activation"
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if linear.packed is None or linear.packed.onednn:
                return "linear layers not on the C kernel"
    if model._lm_head_packed is None or model._lm_head_packed.onednn:
        return "the LM head not on the C kernel"
    try:
        for kernel in ("rms_norm", "rope", "paged_attention", "activation"):
            library(kernel)
        fused.available()                       # built, and its ABI the one mirrored in ctypes
    except BuildError as exc:
        return f"the C kernels: {exc}"
    return None


def batch_dependence(model: LlamaModel) -> str | None:
    """Why a row's result could depend on which rows share its step on this CPU (None: it cannot,
    by construction). Speculative decoding is lossless only where it cannot: a verify row must
    compute what the decode it replaces computes. Every linear layer and the LM head on the C
    kernel (one kernel serves 1 row and many), the C attention and the elementwise C kernels
    give that; PyTorch's and oneDNN's GEMMs and SDPA pick their blocking by shape."""
    mode = os.environ.get("SPECSERVE_KERNELS", "auto")
    if mode != "auto":
        return f"SPECSERVE_KERNELS={mode} runs other kernels than the C ones"
    layouts = model.packed_layouts()
    if None in layouts:
        return ("the linear layers run PyTorch's GEMM (--no-cpu-weight-packing, a model dtype "
                "the C kernel does not take, or no C compiler)")
    if "onednn" in layouts:
        return f"the linear layers run oneDNN's {model.embed_tokens.weight.dtype} GEMM"
    try:
        for kernel in ("rms_norm", "rope", "paged_attention", "activation"):
            library(kernel)
    except BuildError as exc:
        return f"the C kernels do not build here ({exc})"
    return None


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
        self._fused: tuple[tuple[LayerAttention, int], fused.Model, ctypes.Array] | None = None

    @staticmethod
    def enabled() -> bool:
        """SPECSERVE_KERNELS=reference / triton ask for the module path (its ops' choice)."""
        return os.environ.get("SPECSERVE_KERNELS", "auto") == "auto"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, storage: KVStorage,
                meta: PagedAttentionMetadata, slot_mapping: torch.Tensor,
                attention: LayerAttention, layers: list[int] | None = None,
                draft: fused.DraftPages | None = None) -> torch.Tensor:
        """As `LlamaModel.forward` with `runner.PagedAttention`: final-norm hidden states, the
        whole stack in one call of `decoder.c`. draft: a draft step's compressed pages (VeriCache's
        drafter, `proposers/lossy_kv.py`), attended beside the cache's keys."""
        model, n = self.model, input_ids.shape[0]
        run = range(len(model.layers)) if layers is None else layers
        if not len(run):
            return model.norm(model.embed(input_ids))
        b = self._buffers(n)
        b["x"].copy_(model.embed(input_ids))           # the residual stream, updated in place
        cos, sin = self._rope(positions, 1, n)
        short = cpu_attention.short_requests(meta)
        structs, layer_structs = self._structs(attention, meta.block_size)
        fused.forward(structs, layer_structs, torch.tensor(run, dtype=torch.int64), b, cos[0],
                      sin[0], storage.k, storage.v, slot_mapping, short.requests, short.tables,
                      draft=draft)
        return b["h"]

    def draft(self, tokens: torch.Tensor, positions: torch.Tensor, rows_at: list[int],
              storage: KVStorage, bases: list[int], lens: list[int],
              tables: list[tuple[int, ...]], block_size: int, attention: LayerAttention,
              draft: fused.DraftPages | None = None, seconds: torch.Tensor | None = None,
              vocab: tuple[int, cpu_linear.PackedWeight | None, torch.Tensor | None] | None = None
              ) -> tuple[torch.Tensor, list[float]]:
        """Greedy draft steps in one call (`fused.draft`; VeriCache's drafter): step s feeds the
        first rows_at[s] rows (non-increasing) their previous step's argmax (step 0: `tokens`)
        at positions + s, over a drafting cache in `storage` where row r's context is lens[r]
        tokens from slot bases[r] on (its blocks: tables[r], all of one length), attending
        `draft`'s pages too where given. vocab: the drafts' vocabulary (`fused.Head`'s scored,
        extra and extra_ids; None: every token). Returns the drafts [steps, rows] (row r's first
        steps-that-ran-it valid) and each step's seconds. seconds: as `fused.draft`'s."""
        model, rows, steps = self.model, tokens.shape[0], len(rows_at)
        b = self._buffers(rows)
        b["x"].copy_(model.embed(tokens))
        cos, sin = self._rope(positions[None, :] + torch.arange(steps)[:, None], steps, rows)
        structs, layer_structs = self._structs(attention, block_size)
        packed = model._lm_head_packed
        embed = None if model._embedding_in_head else model.embed_tokens.weight.contiguous()
        scored, extra, extra_ids = vocab or (packed.out_features, None, None)
        head = fused.Head(fused.Linear(packed.data.data_ptr(), None,
                                       cpu_linear.LAYOUTS[packed.layout]),
                          None if embed is None else embed.data_ptr(),
                          float(model.embed_scale) if model.config.family.scale_embeddings
                          else 1.0, scored,
                          fused.Linear(None, None, 0) if extra is None else fused.Linear(
                              extra.data.data_ptr(), None, cpu_linear.LAYOUTS[extra.layout]),
                          None if extra_ids is None else extra_ids.data_ptr(),
                          0 if extra is None else extra.out_features)
        out = torch.empty(steps, rows, dtype=torch.int64)
        step_seconds = torch.zeros(steps, dtype=torch.float64)
        fused.draft(structs, layer_structs, torch.arange(len(model.layers)), b,
                    torch.tensor(rows_at, dtype=torch.int64), cos, sin, storage.k, storage.v,
                    torch.tensor(bases, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64),
                    torch.tensor(tables, dtype=torch.int64), draft, head, out,
                    torch.empty(rows, head.scored + head.num_extra), step_seconds,
                    seconds=seconds)
        return out, step_seconds.tolist()

    def _buffers(self, n: int) -> dict[str, torch.Tensor]:
        """A call's buffers for n rows (`fused.Buffers`)."""
        return {"x": torch.empty(n, self.hidden), "h": torch.empty(n, self.hidden),
                "qkv": torch.empty(n, self.qkv_size),
                "qk": torch.empty(n, self.num_heads + self.num_kv_heads, self.head_dim),
                "attn": torch.empty(n, self.q_size), "out": torch.empty(n, self.hidden),
                "gate_up": torch.empty(n, 2 * self.intermediate),
                "act": torch.empty(n, self.intermediate)}

    def _rope(self, positions: torch.Tensor, steps: int, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [steps, RoPE tables, n, head_dim] of positions [steps, n] (a layer reads its
        `DecoderLayer.rope_index`'s table)."""
        tables = self.model.rope_tables(positions.reshape(-1))
        cos = torch.stack([c.reshape(steps, n, self.head_dim) for c, _ in tables], 1)
        sin = torch.stack([s.reshape(steps, n, self.head_dim) for _, s in tables], 1)
        return cos.contiguous(), sin.contiguous()

    def _structs(self, attention: LayerAttention, block_size: int
                 ) -> tuple[fused.Model, ctypes.Array]:
        """`decoder.c`'s view of the model (pointers into its packed weights, which it holds for
        its lifetime), built on the first fused step."""
        if self._fused is None or self._fused[0] != (attention, block_size):
            def linear(module, bias: torch.Tensor | None = None) -> fused.Linear:
                return fused.Linear(module.packed.data.data_ptr(),
                                    None if bias is None else bias.data_ptr(),
                                    cpu_linear.LAYOUTS[module.packed.layout])

            model = self.model
            layers = (fused.Layer * len(model.layers))()

            def norm(module) -> int | None:          # (1 + w) norms: the float32 weight + 1
                return None if module is None else module._float_weight().data_ptr()

            for i, layer in enumerate(model.layers):            # biases as the loop passes them
                layers[i] = fused.Layer(
                    norm(layer.input_layernorm), norm(layer.post_attention_layernorm),
                    norm(layer.q_norm), norm(layer.k_norm), norm(layer.attn_out_norm),
                    norm(layer.mlp_out_norm), linear(layer.qkv_proj, layer.qkv_proj.bias),
                    linear(layer.o_proj), linear(layer.gate_up_proj), linear(layer.down_proj),
                    attention.options(i)["window"], layer.rope_index,
                    cpu_activation.ACTIVATIONS[layer.activation], layer.query_scale)
            structs = fused.Model(self.hidden, self.num_heads, self.num_kv_heads, self.head_dim,
                                  self.intermediate, block_size, self.eps, attention.scale,
                                  attention.softcap, model.norm._float_weight().data_ptr())
            self._fused = ((attention, block_size), structs, layers)
        return self._fused[1], self._fused[2]
