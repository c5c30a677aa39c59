"""Weights: GGUF (dequantized with the `gguf` library; Llama/Mistral, Qwen2, Qwen3), HF folders
(safetensors + config.json read through transformers' `AutoConfig`; the families of
`spec_phases/families.py`), and tiny random-weight models of the same architecture for fast tests.
Loading shows a progress bar. What we cannot serve exactly raises `UnsupportedModelError` (one
line).

A GGUF's quantized linear weights and LM head (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) are
also kept as their raw blocks (`Linear.gguf_blocks`, `LlamaModel.gguf_head`; float32 on CPU only):
the C kernel runs on them quantized (`kernels/cpu/linear.py`: int8 dot products, or float32
activations within float32 rounding of the dequantized weights' results)."""
from __future__ import annotations

import json
import logging
import mmap
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from specserve.kernels.cpu.linear import GGUF_FAMILIES
from specserve.spec_phases.families import (UnsupportedModelError, check_architecture,
                                             hf_tensor_name, model_config)
from specserve.spec_phases.model import FamilyOptions, LlamaModel, ModelConfig
from specserve.spec_phases.paths import (GGUF_CACHE_VERSION, TINY_RANDOM, drop_superseded,
                                         gguf_cache_file, resolve_model_path)
from specserve.spec_phases.rope import RopeConfig

__all__ = ["UnsupportedModelError", "build_random_model", "load_model", "tiny_config"]

logger = logging.getLogger(__name__)
# GGUF types the C kernel reads as they are; a tensor's raw blocks [out, in / 32 * bytes] uint8 are
# kept under "<name>.<layout>"
GGUF_BLOCK_LAYOUTS = {kind.upper(): kind for kind in GGUF_FAMILIES}
_BLOCK_READERS = {"q", "k", "v", "o_proj", "gate", "up", "down_proj", "embed_tokens", "lm_head"}

# GGUF (llama.cpp) tensor name -> ours; HF names: spec_phases/families.py
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "q.weight", "attn_k.weight": "k.weight", "attn_v.weight": "v.weight",
    "attn_q.bias": "q.bias", "attn_k.bias": "k.bias", "attn_v.bias": "v.bias",
    "attn_q_norm.weight": "q_norm.weight", "attn_k_norm.weight": "k_norm.weight",
    "attn_output.weight": "o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "gate.weight", "ffn_up.weight": "up.weight",
    "ffn_down.weight": "down_proj.weight",
}
# GGUF general.architecture -> the architecture we serve it as (llama.cpp writes Mistral as llama)
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM"}
_GGUF_GLOBAL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}


def tiny_config(vocab_size: int = 49152, max_position: int = 4096) -> ModelConfig:
    """Same architecture as SmolLM2 (GQA, tied embeddings), a few hundred times smaller."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope=RopeConfig(10000.0),
                       max_position=max_position, bos_token_id=1, eos_token_ids=(2,))


def load_model(model: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               tiny_seed: int = 0) -> LlamaModel:
    if model == TINY_RANDOM:
        return build_random_model(tiny_config(), dtype, device, seed=tiny_seed)
    path = resolve_model_path(model)
    if path.is_dir():
        cfg, tensors = _read_hf(path, dtype, device)
        return _assemble(cfg, tensors, dtype, device, owned=True)
    cfg, tensors = _read_gguf(path)
    return _assemble(cfg, tensors, dtype, device)


def build_random_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu",
                       seed: int = 0) -> LlamaModel:
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in _split_names(cfg).items():
        if name.endswith("norm.weight"):
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
        if cfg.family.qk_norm:
            shapes.update({p + "q_norm.weight": (cfg.head_dim,),
                           p + "k_norm.weight": (cfg.head_dim,)})
        if cfg.family.sandwich_norms:
            shapes.update({p + "attn_out_norm.weight": (h,), p + "mlp_out_norm.weight": (h,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _assemble(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
              device: str, owned: bool = False) -> LlamaModel:
    """Fuse q/k/v and gate/up (where the checkpoint splits them), cast, and load into a model
    built without random init. Consumes `tensors`: each is popped as it is used, and the model
    takes the (fused, cast) tensors themselves, so the weights are held about once while loading
    (copying into a pre-allocated model held them up to three times: 1.7 GB for SmolLM2 in
    fp32). `owned`: the tensors hold their own memory (read_safetensors), so none is copied.
    """
    layouts = tuple(f".{layout}" for layout in GGUF_BLOCK_LAYOUTS.values())
    blocks = {name: tensors.pop(name) for name in list(tensors) if name.endswith(layouts)}
    if not (torch.device(device).type == "cpu" and dtype == torch.float32):
        blocks.clear()                    # only the float32 C kernel reads them
    kept: dict[str, tuple] = {}           # module -> (GGUF type, blocks) or ("mixed", parts)
    state: dict[str, torch.Tensor] = {}
    fused = {"qkv_proj": "qkv", "gate_up_proj": ("gate", "up"), "o_proj": ("o_proj",),
             "down_proj": ("down_proj",)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name, parts in fused.items():
            found = [next((f"{p}{part}.weight.{kind}" for kind in GGUF_BLOCK_LAYOUTS.values()
                           if f"{p}{part}.weight.{kind}" in blocks), None) for part in parts]
            if all(found):                # one type: its blocks stacked; several: ("mixed", parts)
                kinds = [f.rsplit(".", 1)[1] for f in found]
                part_blocks = [blocks.pop(f) for f in found]
                kept[p + name] = ((kinds[0], torch.cat(part_blocks)) if len(set(kinds)) == 1
                                  else ("mixed", list(zip(kinds, part_blocks))))
            if len(parts) == 1:
                continue
            for leaf in ("weight", "bias"):
                split = [f"{p}{part}.{leaf}" for part in parts]
                if all(s in tensors for s in split):
                    fused_tensor = torch.cat([tensors.pop(s) for s in split])
                    state[f"{p}{name}.{leaf}"] = fused_tensor.to(device=device, dtype=dtype)
    head = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    for layout in GGUF_BLOCK_LAYOUTS.values():
        if f"{head}.weight.{layout}" in blocks:
            kept["head"] = (layout, blocks.pop(f"{head}.weight.{layout}").clone())
    for name in list(tensors):
        # a copy: a tensor read by safetensors' load_file lives in the file's mapping, which stays
        # resident while any tensor of it does (a norm weight would pin all 540 MB). Tensors
        # read_safetensors made are their own memory: taken as they are.
        state[name] = tensors.pop(name).to(device=device, dtype=dtype, copy=not owned)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise UnsupportedModelError(f"{cfg.architecture} checkpoint does not match the model: "
                                    f"missing={missing} unexpected={unexpected}")
    for name, layout_blocks in kept.items():
        if name == "head":
            model.gguf_head = layout_blocks
        else:
            model.get_submodule(name).gguf_blocks = layout_blocks
    model.init_buffers()
    return model.eval().requires_grad_(False)


def _read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The GGUF's config and dequantized tensors, through the dequantized cache when it holds them
    (`gguf_cache_file`): parsing a GGUF's metadata (its ~100K tokenizer strings) and dequantizing
    take ~9 s of a start on a slow 2-core host, reading the cache well under one."""
    from safetensors import SafetensorError

    cached = gguf_cache_file(path)
    if cached.exists():
        try:
            return _read_dequantized(cached)
        except (OSError, ValueError, KeyError, SafetensorError) as exc:    # damaged or older
            logger.warning("ignoring the dequantized cache %s (%s)", cached, exc)
    meta, names, vocab, tensors = _dequantize_gguf(path)
    cfg = _gguf_config(meta, names, vocab)
    _write_dequantized(cached, meta, names, vocab, tensors)
    drop_superseded(cached, path)
    return cfg, tensors


def _read_dequantized(file: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(file), framework="pt") as f:
        header = json.loads(f.metadata()["specserve"])
    if header["version"] != GGUF_CACHE_VERSION:
        raise ValueError(f"cache version {header['version']}")
    return (_gguf_config(header["meta"], set(header["names"]), header["vocab"]),
            load_file(str(file)))


def _write_dequantized(file: Path, meta: dict, names: set[str], vocab: int,
                       tensors: dict[str, torch.Tensor]) -> None:
    """Written to a temporary name and renamed, so a reader never sees half a file; a cache that
    cannot be written (read-only, full disk) is skipped with a warning."""
    from safetensors.torch import save_file

    header = {"version": GGUF_CACHE_VERSION, "meta": meta, "names": sorted(names), "vocab": vocab}
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"specserve": json.dumps(header, default=str)})
        os.replace(tmp, file)
    except OSError as exc:
        logger.warning("could not write the dequantized cache %s (%s)", file, exc)
        tmp.unlink(missing_ok=True)


def _dequantize_gguf(path: Path) -> tuple[dict, set[str], int, dict[str, torch.Tensor]]:
    """-> (metadata without the tokenizer's arrays, tensor names, vocab size, our tensors)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    arch = meta["general.architecture"]
    names = {t.name for t in reader.tensors}
    vocab = int(meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data))
    cfg = _gguf_config(meta, names, vocab)              # refuses what we cannot serve, early
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", leave=False):
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.startswith("blk."):
            _, idx, leaf = t.name.split(".", 2)
            name = f"layers.{idx}.{_GGUF_LAYER[leaf]}"
        else:
            name = _GGUF_GLOBAL[t.name]
        raw = np.asarray(t.data)
        if arch == "llama" and leaf_is(name, "q"):
            w, raw = _unpermute(w, cfg.num_heads), _unpermute(raw, cfg.num_heads)
        elif arch == "llama" and leaf_is(name, "k"):
            w, raw = _unpermute(w, cfg.num_kv_heads), _unpermute(raw, cfg.num_kv_heads)
        usable = w.flags.writeable and w.flags.c_contiguous
        tensors[name] = torch.from_numpy(w if usable else w.copy())
        layout = GGUF_BLOCK_LAYOUTS.get(t.tensor_type.name)
        if layout and name.endswith(".weight") and name.split(".")[-2] in _BLOCK_READERS:
            tensors[f"{name}.{layout}"] = torch.from_numpy(np.ascontiguousarray(raw).copy())
    return meta, names, vocab, tensors


def _gguf_config(meta: dict, names: set[str], vocab: int) -> ModelConfig:
    arch = meta["general.architecture"]
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (GGUF: "
                                    f"{', '.join(_GGUF_ARCHITECTURES)}; other families: load "
                                    f"their HF safetensors folder)")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"GGUF RoPE scaling ({scaling}, or a rope_freqs tensor) is "
                                    f"not supported; load the model's HF safetensors folder")
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta[f"{arch}.attention.head_count_kv"])
    hidden = int(meta[f"{arch}.embedding_length"])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]), num_heads=n_head, num_kv_heads=n_kv,
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // n_head),
        rope=RopeConfig(float(meta.get(f"{arch}.rope.freq_base", 10000.0))),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position=int(meta[f"{arch}.context_length"]),
        tie_word_embeddings="output.weight" not in names,
        architecture=_GGUF_ARCHITECTURES[arch],
        family=FamilyOptions(qk_norm=arch == "qwen3"),
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),))


def leaf_is(name: str, kind: str) -> bool:
    return name.endswith(f".{kind}.weight") or name.endswith(f".{kind}.bias")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of Q/K (interleaved RoPE pairs -> halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model_config(path: Path) -> ModelConfig:
    """config.json through transformers' AutoConfig -> ModelConfig (UnsupportedModelError for an
    architecture or feature we do not serve)."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError):              # a model_type transformers does not know
        raw = json.loads((path / "config.json").read_text())
        check_architecture(raw.get("architectures"), raw.get("model_type"))
        raise
    return model_config(hf)


# safetensors dtype names -> torch (the format: an 8-byte little-endian header length, a JSON
# header of {name: {dtype, shape, data_offsets}}, then the data)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def safetensors_header(file: Path) -> tuple[int, dict]:
    """(where the data starts, {name: entry}) of one .safetensors file."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def _read_exactly(f, offset: int, nbytes: int, what: str) -> torch.Tensor:
    """nbytes at offset, in an anonymous memory map of their own: freed back to the system as
    soon as the tensor is (a malloc'd buffer can stay resident, its heap fragmented by the small
    allocations made between one tensor and the next: 8 MB more per tensor, measured)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = mmap.mmap(-1, nbytes)
    f.seek(offset)
    with memoryview(buf) as view:
        done = 0
        while done < nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise UnsupportedModelError(f"{what}: the file is truncated")
            done += got
    return torch.frombuffer(buf, dtype=torch.uint8)      # keeps buf alive, as long as it is


def read_safetensors(file: Path, dtype: torch.dtype, device: str):
    """Yield (name, tensor) of one .safetensors file one tensor at a time, each read with plain
    file reads (no memory map, whose pages would count in the process' resident memory until the
    whole file is unmapped) into a buffer of the checkpoint's dtype, then cast to `dtype` on
    `device` (no copy where both already match; on CUDA the host buffer is freed once copied).
    Host memory beyond what the caller keeps: about the largest tensor."""
    start, header = safetensors_header(file)
    with open(file, "rb", buffering=0) as f:
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if entry["dtype"] not in _SAFETENSORS_DTYPES:
                raise UnsupportedModelError(f"{file.name}: tensor {name!r} has dtype "
                                            f"{entry['dtype']}, which is not read")
            begin, end = entry["data_offsets"]
            raw = _read_exactly(f, start + begin, end - begin, f"{file.name}: {name!r}")
            t = raw.view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
            if t.is_floating_point():
                t = t.to(device=device, dtype=dtype)
            yield name, t
            del raw, t


def _read_hf(path: Path, dtype: torch.dtype = torch.float32,
             device: str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The folder's safetensors, tensor by tensor, each cast to `dtype` on `device` as it is read:
    host memory peaks at about the served weights (on a CPU; about nothing on CUDA) plus the
    largest tensor in the checkpoint's dtype, never a float32 copy of the model."""
    cfg = hf_model_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors weights (other weight formats "
                                    f"are not read)")
    tensors: dict[str, torch.Tensor] = {}
    count = sum(len(safetensors_header(file)[1]) for file in files)
    with tqdm(total=count, desc=f"loading {path.name}", leave=False) as bar:
        for file in files:
            for name, t in read_safetensors(file, dtype, device):
                bar.update()
                if name.endswith("rotary_emb.inv_freq"):       # a buffer some old exports saved
                    continue
                ours = hf_tensor_name(cfg, name)
                if ours is not None:
                    tensors[ours] = t
    return cfg, tensors
