"""The model families we serve: which architectures, how a transformers config maps onto
`ModelConfig` (with its `FamilyOptions`), and how a family's HF tensor names map onto ours.

Configs are read through transformers' `AutoConfig` (never hand-parsed), so a folder written by
transformers 5 (`rope_parameters`) and an older one (`rope_theta`, `rope_scaling`,
`rope_local_base_freq`) read the same. An architecture outside `SUPPORTED_ARCHITECTURES`, a RoPE
type outside `spec_phases/rope.py`'s, or a feature of a supported family we do not implement is
refused with `UnsupportedModelError`: one line naming what and why.
"""
from __future__ import annotations

from specserve.spec_phases.model import FamilyOptions, ModelConfig
from specserve.spec_phases.rope import RopeConfig, rope_from_parameters

# architecture (config.json's "architectures") -> model_type
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",      # its text model (no image input)
    "Phi3ForCausalLM": "phi3",
}
_GEMMA = FamilyOptions(norm_offset=1.0, scale_embeddings=True, activation="gelu_tanh")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


class UnsupportedModelError(ValueError):
    """A model we cannot serve exactly: the message is one line naming what and why (the CLI
    prints it as is and exits 2)."""


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def check_architecture(architectures: list[str] | None, model_type: str | None) -> str:
    """-> the architecture we serve the checkpoint as, or UnsupportedModelError."""
    archs = list(architectures or [])
    by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
    if archs:
        if len(archs) == 1 and archs[0] in SUPPORTED_ARCHITECTURES:
            return archs[0]
    elif model_type in by_type:
        return by_type[model_type]
    named = archs or [f"model_type={model_type!r}"]
    raise UnsupportedModelError(f"Model architectures {named} are not supported. Supported "
                                f"architectures: [{supported_list()}]")


def _family(hf: dict, model_type: str) -> FamilyOptions:
    # the key transformers' MLP reads: Gemma 2/3 name it hidden_activation
    act = hf["hidden_activation" if model_type in ("gemma2", "gemma3_text") else "hidden_act"]
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"activation {act!r} of {model_type} is not supported "
                                    f"(supported: {list(_ACTIVATIONS)})")
    if model_type in ("gemma", "gemma2", "gemma3_text"):
        fam: dict = {"activation": _ACTIVATIONS[act]}
        if model_type != "gemma":
            fam["sandwich_norms"] = True
            fam["query_pre_attn_scalar"] = float(hf["query_pre_attn_scalar"])
            fam["attn_softcap"] = float(hf["attn_logit_softcapping"] or 0.0)
            fam["final_softcap"] = float(hf["final_logit_softcapping"] or 0.0)
        if model_type == "gemma3_text":
            fam["qk_norm"] = True
        return FamilyOptions(**{**vars(_GEMMA), **fam})
    return FamilyOptions(activation=_ACTIVATIONS[act], qk_norm=model_type == "qwen3")


def _windows(hf: dict, model_type: str) -> tuple[int, ...]:
    """Per layer: the sliding window (keys the query sees, its own included) or 0."""
    window = hf.get("sliding_window")
    if not window:
        return ()
    types = hf.get("layer_types")
    if types is None:                  # Mistral, Phi-3: one window for every layer
        return (int(window),) * hf["num_hidden_layers"]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"{model_type} layer types {unknown} are not supported")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _ropes(hf: dict, model_type: str) -> tuple[RopeConfig, RopeConfig | None]:
    """(RoPE of full-attention layers, of sliding layers where the family gives them their
    own)."""
    params, max_position = hf["rope_parameters"], hf["max_position_embeddings"]
    try:
        if "full_attention" in params or "sliding_attention" in params:
            full = rope_from_parameters(params["full_attention"], max_position)
            local = params.get("sliding_attention")
            local = None if local is None else rope_from_parameters(local, max_position)
            return full, (None if local == full else local)
        return rope_from_parameters(params, max_position), None
    except ValueError as exc:
        raise UnsupportedModelError(f"{model_type}: {exc}") from None


def model_config(hf_config) -> ModelConfig:
    """A transformers `PretrainedConfig` -> our ModelConfig (UnsupportedModelError where we cannot
    serve it exactly)."""
    hf = hf_config.to_dict()
    arch = check_architecture(hf.get("architectures"), hf["model_type"])
    model_type = SUPPORTED_ARCHITECTURES[arch]
    if hf["model_type"] != model_type:
        raise UnsupportedModelError(f"architecture {arch} with model_type {hf['model_type']!r} "
                                    f"is not supported (expected {model_type!r})")
    if model_type == "gemma3":                    # multimodal: serve the text model it holds
        hf, model_type = hf_config.text_config.to_dict(), "gemma3_text"
    for flag in ("use_bidirectional_attention", "mlp_bias"):
        if hf.get(flag):
            raise UnsupportedModelError(f"{arch} with {flag} is not supported")
    n_head = hf["num_attention_heads"]
    rope, local_rope = _ropes(hf, model_type)
    windows = _windows(hf, model_type)
    eos = hf.get("eos_token_id")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=n_head, num_kv_heads=hf.get("num_key_value_heads") or n_head,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rope=rope, local_rope=local_rope if windows else None,
        rms_norm_eps=float(hf["rms_norm_eps"]), max_position=hf["max_position_embeddings"],
        tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        # Qwen2 always has q/k/v biases (its config has no attention_bias)
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        windows=windows, family=_family(hf, model_type), architecture=arch)


# multimodal checkpoints: where their text model's tensors sit, and the towers we do not load
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


# HF per-layer tensor name -> ours. Split q/k/v and gate/up are fused by the loader; Phi-3's fused
# qkv_proj and gate_up_proj are already in our layout (q, k, v rows; gate rows, then up rows).
_HF_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_proj.weight": "q.weight",
    "self_attn.k_proj.weight": "k.weight",
    "self_attn.v_proj.weight": "v.weight",
    "self_attn.q_proj.bias": "q.bias",
    "self_attn.k_proj.bias": "k.bias",
    "self_attn.v_proj.bias": "v.bias",
    "self_attn.qkv_proj.weight": "qkv_proj.weight",
    "self_attn.q_norm.weight": "q_norm.weight",
    "self_attn.k_norm.weight": "k_norm.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.gate_proj.weight": "gate.weight",
    "mlp.up_proj.weight": "up.weight",
    "mlp.gate_up_proj.weight": "gate_up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}
_LLAMA_NORMS = {"post_attention_layernorm.weight": "post_attention_layernorm.weight"}
_SANDWICH_NORMS = {"post_attention_layernorm.weight": "attn_out_norm.weight",
                   "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
                   "post_feedforward_layernorm.weight": "mlp_out_norm.weight"}
_HF_GLOBAL = {"model.embed_tokens.weight": "embed_tokens.weight",
              "model.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}


def hf_tensor_name(cfg: ModelConfig, name: str) -> str | None:
    """An HF checkpoint's tensor name -> ours; None for tensors we do not load (a tied LM head, a
    multimodal checkpoint's vision tower). Raises UnsupportedModelError for a tensor the family
    should not have."""
    if cfg.architecture == "Gemma3ForConditionalGeneration":
        if name.startswith(_OTHER_TOWERS):
            return None
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            name = _TEXT_PREFIXES[prefix] + name[len(prefix):]
    if name.startswith("model.layers."):
        _, _, idx, leaf = name.split(".", 3)
        table = {**_HF_LAYER, **(_SANDWICH_NORMS if cfg.family.sandwich_norms else _LLAMA_NORMS)}
        if leaf not in table:
            raise UnsupportedModelError(f"{cfg.architecture}: unexpected tensor {name!r} in the "
                                        f"checkpoint")
        return f"layers.{idx}.{table[leaf]}"
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    if name not in _HF_GLOBAL:
        raise UnsupportedModelError(f"{cfg.architecture}: unexpected tensor {name!r} in the "
                                    f"checkpoint")
    return _HF_GLOBAL[name]
