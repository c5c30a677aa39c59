"""--kv-cache-dtype bfloat16 / fp8 (vLLM's spellings): the full paged cache in bf16 or fp8 e4m3 on
CPU. The budget holds twice / four times the blocks, the C decoder still serves every step, K/V
written by it are torch's rounding, greedy speculation stays lossless for n-gram and every lossy_kv
compressor (drafts and verify read the same narrow cache), the drafting caches are counted against
the narrow full cache, and other spellings are refused in one line."""
from __future__ import annotations

import pytest
import torch

from specserve.scheduler.config import EngineConfig, SpeculativeConfig
from specserve.scheduler.messages import EngineRequest
from specserve.server.cli import build_parser, check_vllm_flags, engine_config
from specserve.spec_phases import loader
from specserve.spec_phases.model import ModelConfig
from specserve.spec_phases.sampling_params import SamplingParams

PROMPTS = [[(7 * j * (i + 1) + i) % 900 + 3 for j in range(70 + 13 * i)] for i in range(3)]
PROMPTS.append([11, 12, 13, 14, 15] * 12)                    # n-gram drafts on this one
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SMALL_PAGES = {"num_sink": 4, "window": 8, "page_size": 8}
SPECS = {
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                               prompt_lookup_max=3),
    **{f"lossy_kv-{name}": SpeculativeConfig(method="lossy_kv", num_speculative_tokens=6,
                                             kv_compressor=name, kv_compressor_config=cfg)
       for name, cfg in {
           "window": SMALL_PAGES,
           "quant": {**SMALL_PAGES, "key_bits": 4, "value_bits": 2},
           "spherical": {**SMALL_PAGES, "tier": 1, "value_bits": 8, "calib_tokens": 64},
           "mustafar": {"num_sink": 4, "window": 8, "page_size": 64, "sparsity": 0.7}}.items()},
}


def tiny_d64(vocab_size: int = 49152, max_position: int = 4096) -> ModelConfig:
    """The tiny model with head_dim 64 (Mustafar's bitmap tiles need head_dim % 64 == 0)."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=128, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=64, max_position=max_position,
                       bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture
def core(make_engine, monkeypatch):
    monkeypatch.setattr(loader, "tiny_config", tiny_d64)

    def make(device="cpu", **kwargs):
        return make_engine(device=device, dtype="float32", num_threads=1, block_size=8,
                           max_num_batched_tokens=48, **kwargs)
    return make


def generate(core) -> tuple[list[list[int]], int]:
    for i, ids in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"r{i}", ids, PARAMS))
    outs = {f"r{i}": [] for i in range(len(PROMPTS))}
    drafted = 0
    while core.has_unfinished():
        step = core.step()
        for out in step.outputs:
            outs[out.request_id].extend(out.new_token_ids)
        drafted += step.stats.num_draft_tokens
        pool = core.worker.draft_pool
        if pool is not None and pool.states:
            core.last_usage = pool.usage()
    return [outs[f"r{i}"] for i in range(len(PROMPTS))], drafted


# --kv-cache-dtype -> (the cache's torch dtype, the bytes of a float32 cache's element it takes)
NARROW = {"bfloat16": (torch.bfloat16, 2), "fp8": (torch.float8_e4m3fn, 4)}
# the lossless check also runs on CUDA (Triton kernels, graphs) where a GPU is present
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("kv", list(NARROW))
def test_the_budget_holds_more_blocks(core, kv):
    dtype, ratio = NARROW[kv]
    f32, narrow = core(), core(kv_cache_dtype=kv)
    assert f32.worker.storage.k.dtype == torch.float32
    assert narrow.worker.storage.k.dtype == narrow.worker.storage.v.dtype == dtype
    n = f32.worker.num_blocks
    assert ratio * n <= narrow.worker.num_blocks <= ratio * n + ratio
    assert abs(narrow.worker.storage.nbytes - f32.worker.storage.nbytes) <= (
        f32.worker.storage.nbytes / n)
    assert narrow.engine_info.kv_bytes_per_token * ratio == f32.engine_info.kv_bytes_per_token
    assert (narrow.engine_info.kv_cache_dtype, f32.engine_info.kv_cache_dtype) == (
        str(dtype).removeprefix("torch."), "float32")
    assert narrow.engine_info.dtype == "float32"                 # the model's stays float32
    assert narrow.worker.runner.cpu_decoder is not None          # the C decoder serves it


def test_auto_is_bf16_on_the_cpus_fast_path_and_float32_on_the_exact_one(make_engine,
                                                                         monkeypatch):
    """`--kv-cache-dtype auto`: bfloat16 under `--dtype auto` on the CPU (vLLM-CPU's bf16 and
    llama.cpp's f16 caches), float32 under an explicit `--dtype float32` (the exact path); other
    dtypes and CUDA keep the model's; `float32` (not vLLM's) asks for a float32 cache."""
    from specserve.spec_phases.worker import resolve_kv_cache_dtype
    monkeypatch.setattr(loader, "tiny_config", tiny_d64)
    fast, exact = (make_engine(dtype=d, num_threads=1, block_size=8) for d in ("auto", "float32"))
    assert fast.worker.storage.k.dtype == torch.bfloat16 == fast.worker.storage.v.dtype
    assert fast.engine_info.kv_cache_dtype == "bfloat16" and fast.engine_info.dtype == "float32"
    assert exact.worker.storage.k.dtype == torch.float32
    assert fast.worker.runner.cpu_decoder is not None            # the C decoder serves it
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, device="cuda") == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, device="cuda:0") == torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.float32, exact=True) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("float32", torch.bfloat16) == torch.float32
    wide = make_engine(dtype="auto", kv_cache_dtype="float32", num_threads=1, block_size=8)
    assert wide.worker.storage.k.dtype == torch.float32      # int8 activations, float32 cache
    out = generate(fast)[0]                                      # and it decodes
    assert all(len(o) == PARAMS.max_tokens for o in out)


def test_the_c_decoder_writes_torchs_rounding(core):
    """The same tokens through the C decoder and through the modules (KVStorage.write, torch's
    casts) leave the same fp8 bits in the cache, and the same greedy tokens (scheduled by the
    token budget alone, so both place every token in the same slot)."""
    c_core, module_core = (core(kv_cache_dtype="fp8", max_decode_slowdown=None)
                           for _ in range(2))
    module_core.worker.runner.cpu_decoder = None
    outs = [generate(c)[0] for c in (c_core, module_core)]
    assert outs[0] == outs[1]
    k = [c.worker.storage.k.view(torch.uint8) for c in (c_core, module_core)]
    assert k[0].any() and torch.equal(k[0], k[1])


def test_the_one_call_rounds_to_fp8_as_torch_does():
    """float32 -> fp8 e4m3 in `decoder.c` is torch's cast bit for bit: to nearest with ties to
    even (every midpoint between neighbouring e4m3 values), subnormals, saturation at 448 (and
    of infinities), NaNs, signed zeros."""
    from specserve.kernels.cpu import decoder as fused
    g = torch.Generator().manual_seed(0)
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    edges = torch.tensor([0.0, 1e-30, 2.0 ** -10, 447.9, 448.0, 463.9, 464.0, 1e6,
                          float("inf"), float("nan")])
    x = torch.cat([(values[1:] + values[:-1]) / 2, values, edges,
                   *(torch.randn(4096, generator=g) * s for s in (1e-3, 1.0, 100.0))])
    x = torch.cat([x, -x])
    assert torch.equal(fused.round_kv(x, torch.float8_e4m3fn).view(torch.uint8),
                       x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", list(NARROW))
@pytest.mark.parametrize("method", list(SPECS))
def test_speculation_is_lossless_on_a_narrow_cache(core, method, kv, device):
    """Greedy output with speculation equals greedy output without it, both over a bf16 / fp8
    cache, with prompt chunks, decodes and verify rows sharing steps."""
    dtype = NARROW[kv][0]
    plain, _ = generate(core(kv_cache_dtype=kv, device=device))
    spec_core = core(kv_cache_dtype=kv, speculative=SPECS[method], device=device)
    out, drafted = generate(spec_core)
    assert drafted > 0
    assert out == plain
    if method.startswith("lossy_kv"):
        usage = spec_core.last_usage               # counted against the narrow full cache
        cfg = spec_core.worker.model_config
        assert usage.full_bytes_per_token == cfg.kv_bytes_per_token(dtype)
        assert usage.full_bytes == usage.num_tokens * cfg.kv_bytes_per_token(dtype)
        assert spec_core.worker.draft_pool.state_dtype == (
            torch.bfloat16 if kv == "bfloat16" else torch.float16)


@pytest.mark.parametrize("kv", list(NARROW))
def test_the_full_cache_in_the_host_pool_takes_the_narrow_dtype_too(core, kv):
    """lossy_kv with the full cache staged from a host pool (opt-in on CPU): bf16 / fp8 there
    too."""
    from dataclasses import replace

    from specserve.kv_cache.host_pool import HostKVPool
    plain, _ = generate(core(kv_cache_dtype=kv))
    staged = core(kv_cache_dtype=kv,
                  speculative=replace(SPECS["lossy_kv-quant"], full_kv_in_host=True))
    assert isinstance(staged.worker.storage, HostKVPool)
    assert staged.worker.storage.k.dtype == NARROW[kv][0]
    out, drafted = generate(staged)
    assert out == plain and drafted > 0


def test_unknown_spellings_are_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    parser = build_parser()
    for ok in ("fp8", "fp8_e4m3", "float32"):
        check_vllm_flags(parser.parse_args(["serve", "--kv-cache-dtype", ok]))
    for value in ("fp8_e5m2", "bf16", "float16", "int8"):
        with pytest.raises(SystemExit) as info:
            check_vllm_flags(parser.parse_args(["serve", "--kv-cache-dtype", value]))
        assert info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"--kv-cache-dtype {value}:" in lines[0]
    args = parser.parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    check_vllm_flags(args)
    assert engine_config(args).worker_config().kv_cache_dtype == "bfloat16"
    assert engine_config(parser.parse_args(["serve"])).kv_cache_dtype == "auto"
