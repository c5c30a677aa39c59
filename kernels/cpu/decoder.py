"""A step's whole decoder stack in one call of the C kernel `decoder.c` (the kernels the model's
modules call one by one, in the same order: bitwise the same hidden states). The structures
below mirror the C ones field for field; the caller fills them once per model
(`spec_phases/cpu_decoder.py`) and keeps the tensors they point into alive.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from specserve.kernels.cpu.native import BuildError, library

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# what the K/V cache may hold, in decoder.c's `enum kv_dtype` order
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


class Linear(ctypes.Structure):
    _fields_ = [("data", _ptr), ("bias", _ptr), ("layout", _i64)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_attention_norm", _ptr), ("q_norm", _ptr),
                ("k_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("window", _i64), ("rope", _i64), ("activation", _i64),
                ("query_scale", ctypes.c_float)]


class Model(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("block_size", _i64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("final_norm", _ptr)]


class Buffers(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("x", "h", "qkv", "qk", "attn", "out", "gate_up",
                                          "act")]


class QuantPages(ctypes.Structure):
    """One request's `quant` pages of one layer (`draft_attention.c`): its `QuantArena`'s
    tensors, page-major, and how many pages they hold."""
    _fields_ = [(name, _ptr) for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale",
                                          "v_zero")] + [("num_pages", _i64)]


class MustafarPages(ctypes.Structure):
    """One request's Mustafar pages of one layer (`draft_attention.c`), as
    `MustafarCompressor.joined` joins them: 64 * num_blocks tokens."""
    _fields_ = [(name, _ptr) for name in ("k_bitmaps", "k_offsets", "k_values", "v_bitmaps",
                                          "v_offsets", "v_values")] + [("num_blocks", _i64)]


class SphericalPages(ctypes.Structure):
    """One request's Spherical-KV pages of one layer (`draft_attention.c`), all of one tier,
    as `SphericalCompressor.joined` joins them, with the layer's codebook of that tier."""
    _fields_ = [(name, _ptr) for name in ("theta", "radius", "scale", "codebook", "values")] + [
        (name, _i64) for name in ("tokens", "group", "codes")]


# DraftPages.kind: the page format of its table
DRAFT_KINDS = {"quant": (0, QuantPages), "mustafar": (1, MustafarPages),
               "spherical": (2, SphericalPages)}


class DraftPages(ctypes.Structure):
    """A draft step's pages: layer l's of request r at pages[l * row_stride + r], QuantPages or
    MustafarPages as kind says (DRAFT_KINDS)."""
    _fields_ = [("pages", _ptr), ("row_stride", _i64), ("page_size", _i64), ("key_bits", _i64),
                ("value_bits", _i64), ("kind", _i64)]


class Head(ctypes.Structure):
    """The LM head and the token embedding of `draft`'s steps: embed NULL reads the embedding
    from the head's rows (a tied embedding), else from float32 rows [vocab, hidden]. The drafts'
    vocabulary: the head's first `scored` tokens and the num_extra tokens extra_ids (int64,
    ascending, each >= scored) whose rows `extra` holds (`linear.select_outputs`)."""
    _fields_ = [("head", Linear), ("embed", _ptr), ("embed_scale", ctypes.c_float),
                ("scored", _i64), ("extra", Linear), ("extra_ids", _ptr), ("num_extra", _i64)]


ABI_VERSION = 12                    # decoder.c's DECODER_ABI_VERSION that these mirrors match


def check_abi(lib: ctypes.CDLL) -> None:
    """decoder.c's version and structure sizes against the mirrors above (BuildError if not)."""
    structs = (Linear, Layer, Model, Buffers, QuantPages, MustafarPages, SphericalPages,
               DraftPages, Head)
    got = (ctypes.c_int64 * (1 + len(structs)))()
    lib.decoder_abi.restype, lib.decoder_abi.argtypes = None, [_ptr]
    lib.decoder_abi(got)
    want = [ABI_VERSION, *(ctypes.sizeof(t) for t in structs)]
    if list(got) != want:
        raise BuildError(f"decoder.c's ABI (version, struct sizes) {list(got)} is not the "
                         f"one kernels/cpu/decoder.py mirrors, {want}")


@functools.cache
def _kernel():
    return bind(library("decoder"))


def bind(lib: ctypes.CDLL):
    """decoder.c's two entry points in a loaded build, its ABI checked (also the kernel A/B's,
    `benchmarks/decoder_ab.py`)."""
    check_abi(lib)
    fn = lib.decoder_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Layer), _ptr, _i64,
                   ctypes.POINTER(Buffers), _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr,
                   _ptr, _i64, _i64, ctypes.POINTER(DraftPages), _ptr, ctypes.c_int]
    draft = lib.decoder_draft
    draft.restype = ctypes.c_int
    draft.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Layer), _ptr, _i64,
                      ctypes.POINTER(Buffers), _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
                      _i64, _ptr, _ptr, _ptr, _i64, ctypes.POINTER(DraftPages),
                      ctypes.POINTER(Head), _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
    return fn, draft


def draft(model: Model, layers: ctypes.Array, run: torch.Tensor,
          buffers: dict[str, torch.Tensor], rows_at: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bases: torch.Tensor,
          lens: torch.Tensor, tables: torch.Tensor, draft_pages: DraftPages | None, head: Head,
          tokens: torch.Tensor, logits: torch.Tensor, step_seconds: torch.Tensor,
          seconds: torch.Tensor | None = None) -> None:
    """Greedy draft steps in one call (`decoder.c`'s decoder_draft): step s runs the first
    rows_at[s] (int64 [steps], non-increasing) requests' rows over a drafting cache (request r's
    context lens[r] tokens from slot bases[r], its blocks tables[r]), the LM head and each row's
    argmax over head's drafting vocabulary into tokens[s, r] (int64 [steps, R]), the next step's
    input. buffers as `forward`'s, sized for R = rows_at[0] rows, "x" holding step 0's embedded
    rows; cos, sin: float32 [steps, RoPE tables, R, head_dim]; logits: float32 scratch [R,
    head.scored + head.num_extra]; step_seconds: float64 [steps], each step's time; seconds:
    None, or float64 [steps, 3] to which each step's times in the linear layers, attention and
    the elementwise kernels are added (as `forward`'s)."""
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"decoder_draft: a {k_cache.dtype} cache; one of {CACHE_DTYPES}")
    ptrs = Buffers(*(buffers[name].data_ptr() for name, _ in Buffers._fields_))
    status = _kernel()[1](ctypes.byref(model), layers, run.data_ptr(), run.shape[0],
                          ctypes.byref(ptrs), rows_at.data_ptr(), rows_at.shape[0],
                          cos.data_ptr(), sin.data_ptr(), cos.shape[1], k_cache.data_ptr(),
                          v_cache.data_ptr(), CACHE_DTYPES.index(k_cache.dtype),
                          k_cache.shape[1], bases.data_ptr(), lens.data_ptr(), tables.data_ptr(),
                          tables.shape[1],
                          None if draft_pages is None else ctypes.byref(draft_pages),
                          ctypes.byref(head), tokens.data_ptr(), logits.data_ptr(),
                          step_seconds.data_ptr(), None if seconds is None else seconds.data_ptr(),
                          torch.get_num_threads())
    if status:
        raise MemoryError("decoder_draft: a kernel found no scratch memory")


def round_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> bfloat16 or fp8 e4m3 as the one call rounds K/V into such a cache (torch's
    rounding; fp8 saturates at 448 as torch does)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    name = {torch.bfloat16: "decoder_round_bf16", torch.float8_e4m3fn: "decoder_round_fp8"}
    fn = getattr(library("decoder"), name[dtype])
    fn.restype, fn.argtypes = None, [_ptr, _ptr, _i64]
    fn(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def available() -> None:
    """Builds and loads the kernel (raises BuildError where it cannot)."""
    _kernel()


def forward(model: Model, layers: ctypes.Array, run: torch.Tensor,
            buffers: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor,
            slots: torch.Tensor, requests: torch.Tensor, tables: torch.Tensor,
            seconds: torch.Tensor | None = None, draft: DraftPages | None = None) -> None:
    """Runs layers[run] (int64 indices) over buffers["x"] (the embedded rows, the residual stream
    after) into buffers["h"] (the final-norm hidden states); every buffer contiguous float32
    [rows, width] (`decoder.c`); cos, sin: float32 [RoPE tables, rows, head_dim] (a layer reads
    its `rope`'s). k_cache, v_cache: float32, bfloat16 or fp8 e4m3 [layers, slots,
    kv heads, head_dim] (CACHE_DTYPES), written at `slots` (int64 [rows]); requests, tables:
    `paged_attention.short_requests`'s (every query of the step). draft: a draft step's
    compressed pages (one query row a request; a float32 or bfloat16 cache), attended with the
    cache's keys (`draft_attention.c`), or None. seconds:
    None, or float64 [3] to which the call adds its time in the linear layers, in attention (with
    the K/V write) and in the elementwise kernels (`benchmarks/profile_step.py`)."""
    rows = buffers["x"].shape[0]
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"decoder_forward: a {k_cache.dtype} cache; one of {CACHE_DTYPES}")
    ptrs = Buffers(*(buffers[name].data_ptr() for name, _ in Buffers._fields_))
    status = _kernel()[0](ctypes.byref(model), layers, run.data_ptr(), run.shape[0],
                       ctypes.byref(ptrs), rows, cos.data_ptr(), sin.data_ptr(),
                       k_cache.data_ptr(), v_cache.data_ptr(),
                       CACHE_DTYPES.index(k_cache.dtype), k_cache.shape[1],
                       slots.data_ptr(), requests.data_ptr(), tables.data_ptr(), tables.shape[1],
                       requests.shape[0], None if draft is None else ctypes.byref(draft),
                       None if seconds is None else seconds.data_ptr(),
                       torch.get_num_threads())
    if status:
        raise MemoryError("decoder_forward: a kernel found no scratch memory")
