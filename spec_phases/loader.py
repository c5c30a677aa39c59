"""Weights: GGUF (dequantized with the `gguf` library), HF folders (safetensors + config.json), and
tiny random-weight models of the same architecture for fast tests. Loading shows a progress bar."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from specserve.spec_phases.model import LlamaModel, ModelConfig
from specserve.spec_phases.paths import TINY_RANDOM, resolve_model_path

# internal name of each per-layer tensor -> (GGUF name, HF name)
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", "input_layernorm.weight"),
    "q.weight": ("attn_q.weight", "self_attn.q_proj.weight"),
    "k.weight": ("attn_k.weight", "self_attn.k_proj.weight"),
    "v.weight": ("attn_v.weight", "self_attn.v_proj.weight"),
    "q.bias": ("attn_q.bias", "self_attn.q_proj.bias"),
    "k.bias": ("attn_k.bias", "self_attn.k_proj.bias"),
    "v.bias": ("attn_v.bias", "self_attn.v_proj.bias"),
    "o_proj.weight": ("attn_output.weight", "self_attn.o_proj.weight"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "gate.weight": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "up.weight": ("ffn_up.weight", "mlp.up_proj.weight"),
    "down_proj.weight": ("ffn_down.weight", "mlp.down_proj.weight"),
}
_GLOBAL_TENSORS = {
    "embed_tokens.weight": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm.weight": ("output_norm.weight", "model.norm.weight"),
    "lm_head.weight": ("output.weight", "lm_head.weight"),
}


def tiny_config(vocab_size: int = 49152, max_position: int = 4096) -> ModelConfig:
    """Same architecture as SmolLM2 (GQA, tied embeddings), a few hundred times smaller."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                       max_position=max_position, bos_token_id=1, eos_token_ids=(2,))


def load_model(model: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               tiny_seed: int = 0) -> LlamaModel:
    if model == TINY_RANDOM:
        return build_random_model(tiny_config(), dtype, device, seed=tiny_seed)
    path = resolve_model_path(model)
    if path.is_dir():
        cfg, tensors = _read_hf(path)
    else:
        cfg, tensors = _read_gguf(path)
    return _assemble(cfg, tensors, dtype, device)


def build_random_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu",
                       seed: int = 0) -> LlamaModel:
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in _split_names(cfg).items():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            tensors[name] = torch.ones(param)
        elif name.endswith(".bias"):
            tensors[name] = torch.randn(param, generator=gen) * 0.02
        else:
            tensors[name] = torch.randn(param, generator=gen) * (1.0 / param[-1] ** 0.5)
    return _assemble(cfg, tensors, dtype, device)


def _split_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the unfused tensors a checkpoint holds, by internal name."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "q.weight": (q, h),
                       p + "k.weight": (kv, h),
                       p + "v.weight": (kv, h), p + "o_proj.weight": (h, q),
                       p + "post_attention_layernorm.weight": (h,), p + "gate.weight": (inter, h),
                       p + "up.weight": (inter, h), p + "down_proj.weight": (h, inter)})
        if cfg.attention_bias:
            shapes.update({p + "q.bias": (q,), p + "k.bias": (kv,), p + "v.bias": (kv,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _assemble(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
              device: str) -> LlamaModel:
    """Fuse q/k/v and gate/up, cast, and load into a model built without random init."""
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith("layers."):
            prefix, _, leaf = name.rpartition(".")
            prefix, _, kind = prefix.rpartition(".")
            if kind in ("q", "k", "v", "gate", "up"):
                continue
        state[name] = t
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        state[p + "qkv_proj.weight"] = torch.cat([tensors[p + s + ".weight"] for s in "qkv"])
        if cfg.attention_bias:
            state[p + "qkv_proj.bias"] = torch.cat([tensors[p + s + ".bias"] for s in "qkv"])
        state[p + "gate_up_proj.weight"] = torch.cat([tensors[p + "gate.weight"],
                                                      tensors[p + "up.weight"]])
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()},
                                                strict=False)
    missing = [m for m in missing if not m.startswith("rope.")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing={missing} "
                         f"unexpected={unexpected}")
    model.rope = type(model.rope)(cfg.head_dim, cfg.max_position, cfg.rope_theta).to(device)
    return model.to(dtype).eval().requires_grad_(False)


def _read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    arch = meta["general.architecture"]
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (Llama family only)")
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta[f"{arch}.attention.head_count_kv"])
    hidden = int(meta[f"{arch}.embedding_length"])
    names = {t.name for t in reader.tensors}
    vocab = int(meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]), num_heads=n_head, num_kv_heads=n_kv,
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // n_head),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position=int(meta[f"{arch}.context_length"]),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),))
    by_gguf = {g: n for n, (g, _) in _LAYER_TENSORS.items()}
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", leave=False):
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.startswith("blk."):
            _, idx, leaf = t.name.split(".", 2)
            name = f"layers.{idx}.{by_gguf[leaf]}"
        else:
            name = next(n for n, (g, _) in _GLOBAL_TENSORS.items() if g == t.name)
        if arch == "llama" and leaf_is(name, "q"):
            w = _unpermute(w, n_head)
        elif arch == "llama" and leaf_is(name, "k"):
            w = _unpermute(w, n_kv)
        usable = w.flags.writeable and w.flags.c_contiguous
        tensors[name] = torch.from_numpy(w if usable else w.copy())
    return cfg, tensors


def leaf_is(name: str, kind: str) -> bool:
    return name.endswith(f".{kind}.weight") or name.endswith(f".{kind}.bias")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of Q/K (interleaved RoPE pairs -> halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_hf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = json.loads((path / "config.json").read_text())
    if hf.get("rope_scaling"):
        raise NotImplementedError(f"rope_scaling {hf['rope_scaling']} is not supported yet")
    eos = hf.get("eos_token_id")
    n_head = hf["num_attention_heads"]
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=n_head,
        num_kv_heads=hf.get("num_key_value_heads", n_head),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)))
    raw: dict[str, torch.Tensor] = {}
    for file in tqdm(sorted(path.glob("*.safetensors")), desc=f"loading {path.name}", leave=False):
        raw.update(load_file(str(file)))
    by_hf = {h: n for n, (_, h) in _LAYER_TENSORS.items()}
    tensors = {}
    for name, t in raw.items():
        if name.startswith("model.layers."):
            _, _, idx, leaf = name.split(".", 3)
            tensors[f"layers.{idx}.{by_hf[leaf]}"] = t.float()
        else:
            match = [n for n, (_, h) in _GLOBAL_TENSORS.items() if h == name]
            if match and not (cfg.tie_word_embeddings and match[0] == "lm_head.weight"):
                tensors[match[0]] = t.float()
    return cfg, tensors
