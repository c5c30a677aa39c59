"""GGUF files of the Llama, Qwen2 and Qwen3 layouts, written from the tiny transformers checkpoints
with llama.cpp's conventions (tensor names; Llama's Q/K rows permuted for interleaved RoPE): our
engine decodes transformers' greedy ids from them, and transformers' own GGUF reader reads them back
to the original weights (so the files really follow the convention, not just our reader's view of
it). Gemma and Phi-3 GGUFs are refused in one line."""
import numpy as np
import pytest
import torch

from specserve.spec_phases.families import UnsupportedModelError
from specserve.spec_phases.loader import load_model

from specserve.scheduler.config import SpeculativeConfig
from tests.kernels.test_linear_i8 import random_blocks

from test_families import PROMPTS, engine_greedy, hf_greedy

LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time Q/K row order for Llama (RoPE halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


LINEARS = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
           "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}


def write_gguf(model, path, arch: str, linear_type=None, embedding_type=None,
               kinds: dict | None = None) -> None:
    """linear_type, embedding_type: the gguf.GGMLQuantizationType of the layers' linear weights and
    of the token embedding and LM head (None: float32); `kinds`: a type by GGUF tensor leaf name
    instead (a K-quant's blocks are random: gguf cannot quantize to K-quants)."""
    import gguf
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, idx, leaf = name.split(".", 3)
            if arch == "llama" and leaf == "self_attn.q_proj.weight":
                data = permute(data, cfg.num_attention_heads)
            elif arch == "llama" and leaf == "self_attn.k_proj.weight":
                data = permute(data, cfg.num_key_value_heads)
            name = f"blk.{idx}.{LAYER[leaf]}"
        else:
            name = GLOBAL[name]
        kind = linear_type if name.split(".", 2)[-1] in LINEARS else (
            embedding_type if name in ("token_embd.weight", "output.weight") else None)
        if kinds is not None:
            kind = kinds.get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
        if kind is not None and kind.name.endswith("_K"):
            raw = random_blocks(kind.name.lower(), *data.shape, len(name), scale=(2e-4, 1e-3))[0]
            w.add_tensor(name, raw.numpy(), raw_shape=raw.shape, raw_dtype=kind)
            continue
        if kind is not None:
            raw = gguf.quants.quantize(np.ascontiguousarray(data), kind)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
            continue
        w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name,arch", [("llama-gguf", "llama"), ("qwen2-gguf", "qwen2"),
                                       ("qwen3-gguf", "qwen3")])
def test_gguf_decodes_transformers_ids(engines, checkpoints, tmp_path, name, arch):
    from transformers import AutoModelForCausalLM
    _, _, hf = checkpoints(name)
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf, path, arch)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        torch.testing.assert_close(theirs(ids).logits, hf(ids).logits, rtol=1e-3, atol=1e-4)
    assert load_model(str(path)).config.architecture == hf.config.architectures[0]
    assert engine_greedy(engines, path) == [hf_greedy(hf, p) for p in PROMPTS]


def test_gguf_of_another_family_is_refused(checkpoints, tmp_path):
    path = tmp_path / "gemma.gguf"
    write_gguf(checkpoints("gemma")[2], path, "gemma")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gemma' is not supported"):
        load_model(str(path))


def test_dequantized_cache_is_read_back_exactly(checkpoints, tmp_path, monkeypatch):
    """The second load of a GGUF reads the loader's float32 cache (no GGUF parse): the same config
    and bit-identical weights; a damaged cache file is ignored and written afresh."""
    from specserve.spec_phases import loader
    from specserve.spec_phases.paths import gguf_cache_file
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "llama.gguf"
    write_gguf(checkpoints("llama-gguf")[2], path, "llama")
    first = load_model(str(path))
    cached = gguf_cache_file(path)
    assert cached.exists()

    def no_parse(_path):
        raise AssertionError("the GGUF was parsed again")
    monkeypatch.setattr(loader, "_dequantize_gguf", no_parse)
    second = load_model(str(path))
    assert second.config == first.config
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    monkeypatch.undo()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cached.write_bytes(b"not a safetensors file")
    third = load_model(str(path))
    assert third.config == first.config
    assert cached.stat().st_size > 1000                  # rewritten


def test_a_new_copy_of_a_gguf_replaces_its_cache_entry(checkpoints, tmp_path, monkeypatch):
    """Each fresh install puts the same GGUF at a new path (a new key): its cache entry replaces
    the one of the earlier copy, so the cache holds one entry per file name, not one per install;
    another file's entry stays."""
    import shutil

    from specserve.spec_phases.paths import gguf_cache_file
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first, second, other = tmp_path / "a" / "llama.gguf", tmp_path / "b" / "llama.gguf", \
        tmp_path / "a" / "llama-other.gguf"
    first.parent.mkdir()
    second.parent.mkdir()
    write_gguf(checkpoints("llama-gguf")[2], first, "llama")
    shutil.copy(first, other)
    load_model(str(first))
    load_model(str(other))
    shutil.copy(first, second)
    load_model(str(second))
    entries = sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir())
    assert entries == sorted([gguf_cache_file(second).name, gguf_cache_file(other).name])
    assert gguf_cache_file(first) != gguf_cache_file(second)


def test_model_description_reads_the_cache_and_a_failed_write_is_skipped(checkpoints, tmp_path,
                                                                           monkeypatch):
    """Once cached, the HTTP side's model description comes from the cache's metadata (no GGUF
    parse); a cache that cannot be written leaves no file behind and the model still loads."""
    import gguf
    import safetensors.torch

    from specserve.spec_phases.paths import describe_model, gguf_cache_file
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "qwen2.gguf"
    write_gguf(checkpoints("qwen2-gguf")[2], path, "qwen2")

    def full_disk(*_args, **_kwargs):
        raise OSError("No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    model = load_model(str(path))
    assert model.config.architecture == "Qwen2ForCausalLM"
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []      # no file, no temporary
    monkeypatch.undo()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    load_model(str(path))
    assert gguf_cache_file(path).exists()

    def no_parse(*_args, **_kwargs):
        raise AssertionError("the GGUF was parsed")
    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    assert describe_model(path) == "qwen2 (GGUF)"


@pytest.mark.parametrize("linear_type", ["Q4_1", "Q8_0"])
def test_gguf_blocks_run_quantized_as_dequantized(engines, checkpoints, tmp_path, monkeypatch,
                                                  linear_type):
    """A GGUF with quantized linear weights and a Q8_0 embedding and head: the C kernel runs on the
    blocks as they are and computes the logits of the dequantized weights within float32 rounding
    (the embedding rows exactly); greedy ids equal transformers' on the same file (it
    dequantizes); the cache keeps the blocks."""
    import gguf
    from transformers import AutoModelForCausalLM

    from specserve.spec_phases import loader
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"llama-{linear_type}.gguf"
    types = gguf.GGMLQuantizationType
    write_gguf(checkpoints("llama-gguf")[2], path, "llama", types[linear_type], types.Q8_0)
    quantized, dense = load_model(str(path)), load_model(str(path))    # the second: the cache
    layout = linear_type.lower()
    assert quantized.layers[0].qkv_proj.gguf_blocks[0] == layout
    assert dense.layers[1].gate_up_proj.gguf_blocks[0] == layout
    assert dense.gguf_head[0] == "q8_0"
    dense.drop_gguf_blocks()
    assert quantized.pack_for_cpu() and dense.pack_for_cpu()
    assert {layer.down_proj.packed.layout for layer in quantized.layers} == {layout}
    assert quantized._lm_head_packed.layout == "q8_0"
    assert quantized._embedding_in_head == quantized.config.tie_word_embeddings
    assert {layer.qkv_proj.packed.layout for layer in dense.layers} == {"f32"}
    assert quantized.bytes_per_step() < dense.bytes_per_step()
    ids, pos = torch.tensor(PROMPTS[0]), torch.arange(len(PROMPTS[0]))

    def causal(layer, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=True)
        return o.transpose(0, 1)
    with torch.inference_mode():
        assert torch.equal(quantized.embed(ids), dense.embed(ids))
        torch.testing.assert_close(quantized.compute_logits(quantized(ids, pos, causal)),
                                   dense.compute_logits(dense(ids, pos, causal)),
                                   rtol=1e-4, atol=1e-4)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32)
    assert engine_greedy(engines, path) == [hf_greedy(theirs, p) for p in PROMPTS]
    # the blocks are kept only where the float32 C kernel can read them
    bf16 = loader.load_model(str(path), torch.bfloat16)
    assert bf16.layers[0].qkv_proj.gguf_blocks is None and bf16.gguf_head is None


def test_k_quant_mix_runs_from_its_blocks(engines, checkpoints, tmp_path, monkeypatch):
    """A Q4_K_M-like file (Q4_K q, k, o, gate, up and embedding; Q6_K v, down and head): every
    linear and the head stay quantized with int8 activations (q/k/v mixed: one U8 panel set),
    greedy ids are the same with speculation on and off; with float32 activations the Q4_K
    weights run from their blocks and the greedy ids are transformers' on the same file."""
    import gguf
    from transformers import AutoModelForCausalLM
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    t = gguf.GGMLQuantizationType
    kinds = {"attn_q.weight": t.Q4_K, "attn_k.weight": t.Q4_K, "attn_v.weight": t.Q6_K,
             "attn_output.weight": t.Q4_K, "ffn_gate.weight": t.Q4_K, "ffn_up.weight": t.Q4_K,
             "ffn_down.weight": t.Q6_K, "token_embd.weight": t.Q4_K, "output.weight": t.Q6_K}
    path = tmp_path / "llama-q4_k_m.gguf"
    write_gguf(checkpoints("llama-kquant-gguf")[2], path, "llama", kinds=kinds)
    quantized, dense = load_model(str(path)), load_model(str(path))
    assert quantized.layers[0].qkv_proj.gguf_blocks[0] == "mixed"
    assert quantized.layers[1].gate_up_proj.gguf_blocks[0] == "q4_k"
    assert quantized.gguf_head[0] == "q6_k"
    dense.drop_gguf_blocks()
    assert quantized.pack_for_cpu(int8=True) and dense.pack_for_cpu()
    layer = quantized.layers[0]
    assert [m.packed.layout for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                      layer.down_proj)] == ["u8_i8", "q4_k_i8", "q4_k_i8",
                                                            "u8s_i8"]
    assert quantized._lm_head_packed.layout == "u8s_i8"
    assert quantized.bytes_per_step() * 3 < dense.bytes_per_step()
    greedy = {}
    for name, spec in (("off", None), ("ngram", SpeculativeConfig(
            method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)),
            ("layer_skip", SpeculativeConfig(method="layer_skip", num_speculative_tokens=3,
                                             skip_layers=(1,)))):
        greedy[name] = engine_greedy(engines, path, dtype="auto", speculative=spec)
    assert greedy["ngram"] == greedy["off"] == greedy["layer_skip"]
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32)
    assert engine_greedy(engines, path) == [hf_greedy(theirs, p) for p in PROMPTS]
