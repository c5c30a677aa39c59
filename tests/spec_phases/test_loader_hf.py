"""HF folders (config.json + safetensors) load into the same model; Qwen2-style QKV bias works."""
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from specserve.spec_phases.loader import build_random_model, load_model, tiny_config
from specserve.spec_phases.model import ModelConfig


def causal(layer, q, k, v):
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True)
    return o.transpose(0, 1)


ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def export_hf(model, cfg: ModelConfig, folder, model_type="llama"):
    """Write our model in HF Llama/Qwen2 layout: un-fuse qkv and gate_up, HF tensor names."""
    sd, t = {}, model.state_dict()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd["model.embed_tokens.weight"] = t["embed_tokens.weight"]
    sd["model.norm.weight"] = t["norm.weight"]
    for i in range(cfg.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = t[p + "qkv_proj.weight"].split([q, kv, kv])
        sd.update({h + "self_attn.q_proj.weight": wq, h + "self_attn.k_proj.weight": wk,
                   h + "self_attn.v_proj.weight": wv,
                   h + "self_attn.o_proj.weight": t[p + "o_proj.weight"],
                   h + "input_layernorm.weight": t[p + "input_layernorm.weight"],
                   h + "post_attention_layernorm.weight": t[p + "post_attention_layernorm.weight"],
                   h + "mlp.down_proj.weight": t[p + "down_proj.weight"]})
        gate, up = t[p + "gate_up_proj.weight"].chunk(2)
        sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"] = gate, up
        if cfg.attention_bias:
            bq, bk, bv = t[p + "qkv_proj.bias"].split([q, kv, kv])
            sd.update({h + "self_attn.q_proj.bias": bq, h + "self_attn.k_proj.bias": bk,
                       h + "self_attn.v_proj.bias": bv})
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": [ARCHS[model_type]],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "rope_theta": cfg.rope.theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": [2, 0]}))


def test_hf_folder_round_trip(tmp_path):
    cfg = tiny_config(vocab_size=300)
    original = build_random_model(cfg, seed=5)
    export_hf(original, cfg, tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.eos_token_ids == (2, 0) and loaded.config.num_kv_heads == cfg.num_kv_heads
    ids, pos = torch.tensor([4, 8, 15, 16, 23, 42]), torch.arange(6)
    torch.testing.assert_close(loaded.compute_logits(loaded(ids, pos, causal)),
                               original.compute_logits(original(ids, pos, causal)))


def test_qwen2_style_bias_is_loaded_and_used(tmp_path):
    cfg = replace(tiny_config(vocab_size=300), attention_bias=True)
    original = build_random_model(cfg, seed=6)
    assert original.layers[0].qkv_proj.bias is not None
    export_hf(original, cfg, tmp_path, model_type="qwen2")
    loaded = load_model(str(tmp_path))
    assert loaded.config.attention_bias
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    torch.testing.assert_close(loaded(ids, pos, causal), original(ids, pos, causal))


def test_bfloat16_option_runs(make_engine):
    from specserve.scheduler.messages import EngineRequest
    from specserve.spec_phases.sampling_params import SamplingParams
    core = make_engine(dtype="bfloat16")
    assert core.worker.storage.k.dtype == torch.bfloat16
    core.add_request(EngineRequest("bf", [5, 6, 7],
                                   SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    assert sum(len(o.new_token_ids) for o in core.run_until_idle()) == 4



def test_the_loader_maps_no_file_and_the_model_owns_its_tensors(tmp_path, monkeypatch):
    """The folder is read tensor by tensor with plain reads, never through safetensors' memory
    map (whose pages stay resident while any tensor of the file does: a norm weight kept alive
    would pin the whole file after the linear weights were packed and dropped)."""
    import safetensors
    import safetensors.torch
    cfg = tiny_config(vocab_size=256, max_position=64)
    export_hf(build_random_model(cfg), cfg, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("the loader mapped the file")
    for module, name in ((safetensors.torch, "load_file"), (safetensors, "safe_open"),
                         (safetensors.torch, "safe_open")):
        monkeypatch.setattr(module, name, refuse, raising=False)
    model = load_model(str(tmp_path))
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(storages) == len(set(storages))
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.is_contiguous(), name


def reference_load(folder, dtype):
    """What the loader did before it read tensor by tensor: safetensors' load_file, every tensor
    to float32, then cast by _assemble."""
    from safetensors.torch import load_file

    from specserve.spec_phases import loader
    cfg = loader.hf_model_config(folder)
    tensors = {loader.hf_tensor_name(cfg, k): v.float()
               for k, v in load_file(str(folder / "model.safetensors")).items()}
    return loader._assemble(cfg, {k: v for k, v in tensors.items() if k}, dtype, "cpu")


@pytest.mark.parametrize("stored, served", [(torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.float16, torch.bfloat16),
                                            (torch.float32, torch.float32)])
def test_tensor_by_tensor_reads_the_same_weights(tmp_path, stored, served):
    """Read in the checkpoint's dtype and cast once: bit for bit the weights the float32 detour
    gave, in every stored/served pair."""
    cfg = tiny_config(vocab_size=300)
    export_hf(build_random_model(cfg, seed=9).to(stored), cfg, tmp_path)
    loaded, ref = load_model(str(tmp_path), served), reference_load(tmp_path, served)
    got, want = loaded.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype == (served if want[name].is_floating_point()
                                                       else want[name].dtype), name
        assert torch.equal(got[name], want[name]), name
