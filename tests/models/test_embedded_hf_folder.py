"""The embedded SmolLM2 GGUF converted by transformers 5 into a safetensors folder (its config says
`rope_parameters: {rope_theta: 100000}`, no top-level `rope_theta`) serves the same greedy text as
the GGUF: a loader that fell back to RoPE base 10000 answered this chat in broken French."""
import json

import pytest
import torch

from specserve.scheduler.messages import EngineRequest
from specserve.server.tokenizer import load_tokenizer
from specserve.spec_phases.loader import load_model
from specserve.spec_phases.paths import embedded_model_path
from specserve.spec_phases.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers greater than 100."]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    gguf = embedded_model_path()
    folder = tmp_path_factory.mktemp("smollm2-hf")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # the weights are dequantized to float32 already; transformers only keeps the GGUF marker,
    # which refuses to serialize
    model.hf_quantizer = None
    vars(model.config).pop("quantization_config", None)
    model.save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    return folder


def greedy_text(engines, model, tokenizer, max_tokens=32):
    core = engines.core(model=model, dtype="float32", device="cpu", kv_cache_memory_gb=0.2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, chat in enumerate(CHATS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": chat}],
                                             add_generation_prompt=True, tokenize=False)
        core.add_request(EngineRequest(f"c{i}", tokenizer.encode(text, add_special_tokens=False),
                                       params))
    outs = {f"c{i}": [] for i in range(len(CHATS))}
    while core.has_unfinished():
        for out in core.step().outputs:
            outs[out.request_id].extend(out.new_token_ids)
    return [tokenizer.decode(outs[f"c{i}"], skip_special_tokens=True)
            for i in range(len(CHATS))]


def test_transformers5_folder_serves_the_gguf_text(engines, hf_folder):
    config = json.loads((hf_folder / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 100000.0
    assert load_model(str(hf_folder)).config.rope.theta == 100000.0
    from_folder = greedy_text(engines, str(hf_folder), load_tokenizer(str(hf_folder)))
    from_gguf = greedy_text(engines, None, load_tokenizer(None))
    assert from_folder == from_gguf
    assert "The capital of France is Paris" in from_folder[0]
