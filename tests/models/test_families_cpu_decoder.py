"""transformers' own tiny checkpoints of Gemma 1/2/3 (the multimodal one's text model too) and
Phi-3, served in float32, take the one-call C decoder (`kernels/cpu/decoder.c`): its hidden states,
K/V and logits are bitwise the modules' (`LlamaModel.forward`), its logits transformers' within
float32 error, and greedy speculation changes no token of the engine's output."""
import pytest
import torch

from specserve.scheduler.config import SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.spec_phases import cpu_decoder
from specserve.spec_phases.loader import load_model
from specserve.spec_phases.sampling_params import SamplingParams

PROMPTS = [[(11 * j + 5) % 250 + 3 for j in range(21)], [7, 8, 9, 10] * 4 + [7]]


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3", "gemma3-multimodal", "phi3"])
def test_the_c_decoder_serves_the_family_bitwise_the_modules(checkpoints, name, decoder_runners,
                                                             same_steps):
    new, _, hf = checkpoints(name)
    model = load_model(str(new))
    assert model.pack_for_cpu()
    assert cpu_decoder.unsupported(model) is None
    fast, modules = decoder_runners(model, num_blocks=24)
    a, b = PROMPTS
    tables = [tuple(range(0, 8)), tuple(range(8, 16))]
    steps = [([tuple(a[:12]), tuple(b)], [0, 0], tables),             # a chunk, a prompt
             ([tuple(a[12:]), (5,)], [12, 17], tables),               # the rest, a decode
             ([(7,), (8, 9, 10, 11)], [21, 18], tables)]              # decode, verify rows
    same_steps(fast, modules, steps)
    # the C decoder's prefill logits are transformers' (float32 error apart)
    fresh, _ = decoder_runners(model, num_blocks=24)
    mine = fresh.compute_logits(fresh.forward([tuple(a)], [0], [tables[0]]))
    with torch.inference_mode():
        theirs = (hf(torch.tensor([a])).logits[0] if name != "gemma3-multimodal" else
                  hf(input_ids=torch.tensor([a])).logits[0])
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def greedy(engines, folder, speculative=None):
    core = engines.core(model=str(folder), dtype="float32", device="cpu",
                        kv_cache_memory_gb=0.05, block_size=4, max_num_batched_tokens=16,
                        num_threads=1, speculative=speculative)
    assert core.worker.runner.cpu_decoder is not None            # the one C call serves it
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"p{i}", ids, params))
    outs, drafted = {f"p{i}": [] for i in range(len(PROMPTS))}, 0
    while core.has_unfinished():
        step = core.step()
        drafted += step.stats.num_draft_tokens
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
    return [outs[f"p{i}"] for i in range(len(PROMPTS))], drafted


def test_greedy_speculation_on_gemma2_is_lossless_on_the_c_decoder(engines, checkpoints):
    """Gemma 2 (sandwich norms, GeGLU, query scale, score and logit soft-caps, a sliding layer)
    on the C decoder: n-gram speculation's verify rows give the ids plain decoding gives."""
    folder = checkpoints("gemma2")[0]
    plain, _ = greedy(engines, folder)
    spec, drafted = greedy(engines, folder, SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
    assert drafted > 0
    assert spec == plain
