"""Every supported family, on tiny random weights transformers wrote: our engine's greedy ids equal
transformers' greedy `generate` in float32, from the transformers-5 folder and from the older
config spelling; unsupported architectures and RoPE types are refused in one line."""
import json
import shutil

import pytest
import torch

from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases.families import UnsupportedModelError
from specserve.spec_phases.loader import load_model
from specserve.spec_phases.sampling_params import SamplingParams

from conftest import FAMILIES

PROMPTS = [[(11 * j + 5) % 250 + 3 for j in range(21)], [7, 8, 9, 10] * 4 + [7]]
NEW_TOKENS = 14


def hf_greedy(model, prompt):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_greedy(engines, folder, dtype="float32", **cfg):
    core = engines.core(model=str(folder), dtype=dtype, device="cpu", kv_cache_memory_gb=0.05,
                        block_size=4, max_num_batched_tokens=12, num_threads=1, **cfg)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"p{i}", ids, params))
    outs = {f"p{i}": [] for i in range(len(PROMPTS))}
    while core.has_unfinished():
        for out in core.step().outputs:
            outs[out.request_id].extend(out.new_token_ids)
    return [outs[f"p{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", [*FAMILIES, "gemma3-multimodal"])
def test_greedy_ids_match_transformers(engines, checkpoints, name):
    new, old, hf = checkpoints(name)
    want = [hf_greedy(hf, p) for p in PROMPTS]
    assert engine_greedy(engines, new) == want
    # the older spelling reads the same RoPE (not the 10000 fallback) and decodes the same ids
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    assert load_model(str(old)).config == load_model(str(new)).config
    assert engine_greedy(engines, old) == want


def test_family_options_are_read(checkpoints):
    cfg = load_model(str(checkpoints("gemma3")[1])).config
    assert (cfg.architecture, cfg.windows, cfg.rope.theta, cfg.rope.type, cfg.rope.factor,
            cfg.local_rope.theta) == ("Gemma3ForCausalLM", (8, 0), 100000.0, "linear", 2.0, 5000.0)
    fam = cfg.family
    assert (fam.norm_offset, fam.scale_embeddings, fam.activation, fam.qk_norm,
            fam.sandwich_norms, fam.query_pre_attn_scalar) == (1.0, True, "gelu_tanh", True,
                                                               True, 48.0)
    g2 = load_model(str(checkpoints("gemma2")[0])).config
    assert (g2.head_dim, g2.family.attn_softcap, g2.family.final_softcap) == (256, 2.0, 3.0)
    assert load_model(str(checkpoints("qwen2")[0])).config.attention_bias
    assert load_model(str(checkpoints("mistral")[0])).config.windows == (8, 8)
    assert load_model(str(checkpoints("llama3")[1])).config.rope.original_max_position == 64


def test_window_and_softcap_change_the_output(checkpoints):
    """The options the families declare are really applied: switching one off changes logits."""
    from dataclasses import replace

    from specserve.spec_phases.calibration import DenseCache

    ids = torch.tensor(PROMPTS[0])
    for name in ("mistral", "gemma2"):
        model = load_model(str(checkpoints(name)[0]))
        hf = checkpoints(name)[2]
        with torch.inference_mode():
            theirs = hf(ids[None]).logits[0]
        mine = engine_logits(model, ids)
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        # calibration's dense forward (layer-skip set, Spherical-KV's text) is the same model
        dense = DenseCache(model.config.attention())
        with torch.inference_mode():
            dense_logits = model.compute_logits(model(ids, torch.arange(len(ids)), dense))
        torch.testing.assert_close(dense_logits, theirs, rtol=1e-4, atol=1e-4)
        plain = replace(model.config, windows=(), family=replace(model.config.family,
                                                                 attn_softcap=0.0))
        model.config = plain
        assert not torch.allclose(engine_logits(model, ids), theirs, atol=1e-3)


def engine_logits(model, ids):
    """Prefill through the runner's paged attention (block size 4) -> logits [n, vocab]."""
    from specserve.kv_cache.storage import KVStorage
    from specserve.spec_phases.runner import ModelRunner
    cfg = model.config
    storage = KVStorage(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                        "cpu")
    runner = ModelRunner(model, storage)
    table = tuple(range(-(-len(ids) // 4)))
    return runner.compute_logits(runner.forward([tuple(ids.tolist())], [0], [table]))


def test_unsupported_architecture_is_refused_in_one_line(tmp_path, checkpoints):
    folder = tmp_path / "olmo"
    shutil.copytree(checkpoints("llama")[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "olmo",
                                                    "architectures": ["OlmoForCausalLM"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(str(folder))
    msg = str(err.value)
    assert "\n" not in msg and "OlmoForCausalLM" in msg and "are not supported" in msg
    assert "Gemma2ForCausalLM" in msg and "Phi3ForCausalLM" in msg
    # a model_type transformers does not know at all: named too
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "nosuch",
                                                    "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match=r"\['NoSuchForCausalLM'\] are not supported"):
        load_model(str(folder))


def test_unsupported_rope_type_is_refused(tmp_path, checkpoints):
    folder = tmp_path / "longrope"
    shutil.copytree(checkpoints("llama")[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                              "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
                              "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="RoPE type 'longrope' is not supported") as e:
        load_model(str(folder))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_prefix_cache_hits_decode_the_same_ids(engines, checkpoints, name):
    """A prompt served again from the prefix cache (its first blocks lie outside the window)
    decodes transformers' ids too."""
    new, _, hf = checkpoints(name)
    prompt = PROMPTS[0]
    core = engines.core(model=str(new), dtype="float32", device="cpu", kv_cache_memory_gb=0.05,
                        block_size=4, num_threads=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    runs = []
    for i in range(2):
        core.add_request(EngineRequest(f"r{i}", prompt, params))
        ids, cached = [], 0
        while core.has_unfinished():
            for out in core.step().outputs:
                ids.extend(out.new_token_ids)
                cached = max(cached, out.num_cached_tokens)
        runs.append((ids, cached))
    want = hf_greedy(hf, prompt)
    assert runs[0] == (want, 0)
    assert runs[1][0] == want and runs[1][1] >= 16


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_calibration_text_follows_windows_and_softcaps(checkpoints, name):
    """own_text (one token per step over a dense cache, the text Spherical-KV calibrates on) is
    the model's greedy text, past its sliding window."""
    from specserve.spec_phases.calibration import own_text
    new, _, hf = checkpoints(name)
    text = own_text(load_model(str(new)), num_seqs=2, length=20, temperature=0)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([[1]]), max_new_tokens=20, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0].tolist()
    assert text.token_ids[0] == want
