"""Tiny random-weight checkpoints of every supported family, written by transformers 5
(`save_pretrained`), and the same folder rewritten in the older config spelling (top-level
`rope_theta` / `rope_scaling` / `rope_local_base_freq`, no `rope_parameters`).

Every family's options are set so they matter on 2-layer models: head_dim other than
hidden / heads, a sliding window of 8 keys under prompts of ~20 tokens, soft-caps small enough to
bite, query_pre_attn_scalar other than head_dim, a RoPE base other than the 10000 a loader would
fall back to. Weights are drawn with a spread that keeps greedy choices clear of ties (transformers'
own init, std 0.02, leaves logits nearly flat)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}),
    "llama3": ("llama", {"rope_parameters": LLAMA3}),
    "llama_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 50000.0,
                                                   "factor": 4.0}}),
    "llama_dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic",
                                                    "rope_theta": 50000.0, "factor": 4.0}}),
    "qwen2_yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0,
                                                 "factor": 4.0,
                                                 "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                        "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}),
    "mistral": ("mistral", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                            "sliding_window": 8}),
    "gemma": ("gemma", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                        "tie_word_embeddings": True}),
    "gemma_gelu": ("gemma", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                             "hidden_act": "gelu"}),           # Gemma 1's exact GeLU
    "gemma2": ("gemma2", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                          "head_dim": 256, "sliding_window": 8, "query_pre_attn_scalar": 144,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                          "tie_word_embeddings": True}),
    "gemma3": ("gemma3_text", {
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 100000.0,
                                               "factor": 2.0}},
        "sliding_window": 8, "query_pre_attn_scalar": 48,
        "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True}),
    "phi3": ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                      "sliding_window": 8}),
}
# for GGUF (tests/models/test_families_gguf.py): transformers' GGUF reader takes head_dim as
# hidden / heads (Llama, Qwen2) or its config's default 128 (Qwen3), so these match it
GGUF_LAYOUTS = {f"{name}-gguf": (FAMILIES[name][0], {**FAMILIES[name][1], "hidden_size": 128,
                                                     "head_dim": 128 if name == "qwen3" else 64})
                for name in ("llama", "qwen2", "qwen3")}
# a Llama whose every linear's input is a multiple of 256 (K-quant super-blocks), for GGUF K-quants
GGUF_LAYOUTS["llama-kquant-gguf"] = ("llama", {**FAMILIES["llama"][1], "hidden_size": 256,
                                               "intermediate_size": 512, "num_attention_heads": 4,
                                               "num_key_value_heads": 2, "head_dim": 64})
FAMILY_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
               "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def hf_config(name: str):
    from transformers import AutoConfig
    if name == "gemma3-multimodal":               # Gemma 3 4B+: a text model beside a vision tower
        text = hf_config("gemma3").to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)
        cfg = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision,
                                   mm_tokens_per_image=4, image_token_index=255,
                                   boi_token_index=253, eoi_token_index=254)
        cfg.architectures = ["Gemma3ForConditionalGeneration"]
        return cfg
    model_type, extra = {**FAMILIES, **GGUF_LAYOUTS}[name]
    fields = {**BASE, **extra}
    if model_type == "phi3":                      # Phi-3 has no head_dim: hidden / heads
        fields = {**fields, "hidden_size": 128}
        del fields["head_dim"]
    cfg = AutoConfig.for_model(model_type, **json.loads(json.dumps(fields)))
    cfg.architectures = [FAMILY_ARCH[model_type]]
    return cfg


@torch.no_grad()
def randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    offset_norms = model.config.model_type.startswith("gemma")     # (1 + w): w around 0
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(noise * 0.2 + (0.0 if offset_norms else 1.0))
        elif name.endswith("bias"):
            p.copy_(noise * 0.2)
        elif "embed_tokens" in name:
            p.copy_(noise / (math.sqrt(p.shape[1]) if offset_norms else 1.0))
        else:
            p.copy_(noise * 1.5 / math.sqrt(p.shape[-1]))


def old_spelling(src: Path, dst: Path) -> None:
    """The same checkpoint with the config spelled as before transformers 5."""
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    text = cfg.get("text_config", cfg)            # a multimodal config: its text model's
    params = text.pop("rope_parameters")
    if "full_attention" in params:                # Gemma 3: global and local bases
        text["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    text["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        text["rope_scaling"] = params
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


class Checkpoints:
    """Each family's folders, written once per session: (transformers-5 folder, old-spelling
    folder, the transformers model in float32)."""

    def __init__(self, root: Path):
        self.root, self.built = root, {}

    def __call__(self, name: str):
        if name not in self.built:
            from transformers import AutoModelForCausalLM
            torch.manual_seed(0)
            from transformers import AutoModelForImageTextToText
            auto = AutoModelForImageTextToText if name == "gemma3-multimodal" else \
                AutoModelForCausalLM
            model = auto.from_config(hf_config(name), dtype=torch.float32,
                                     attn_implementation="eager")
            randomize(model, seed=sum(map(ord, name)))
            new, old = self.root / name, self.root / f"{name}-old"
            model.save_pretrained(new)
            old_spelling(new, old)
            self.built[name] = (new, old, model.eval())
        return self.built[name]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("families"))
