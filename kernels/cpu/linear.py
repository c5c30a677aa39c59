"""Linear layers on the CPU, on weights packed once at load: the C kernel `linear.c` for float32
(column panels; every output element summed over k in one fixed order, so a row's result does
not depend on how many rows share the call, as oneDNN's and MKL's do), oneDNN's prepacked GEMM
for bfloat16 (where the CPU has AVX512-BF16 or AMX) and for float32 where no C compiler is
available. GGUF blocks stay quantized in the C kernel's panels (`pack_gguf`): with float32
activations (Q4_0, Q4_1, Q4_K, Q5_0 and Q8_0: `GGUF_FAMILIES`) it factors each block's
scale and minimum out of the block's sums and computes the dequantized weight's results within
float32 rounding; with int8 activations (`linear_i8.c`, every listed type) it sums codes times
codes on int8 dot products. The one home of the CPU GEMM choice."""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from specserve.kernels.cpu.native import BuildError, library

logger = logging.getLogger(__name__)

PANEL = 16                      # output columns per packed panel (linear.c)
QBLOCK = 32                     # GGUF's quantization block along the input dimension
Q4_1_BLOCK_BYTES = 20           # GGUF Q4_1: d (fp16), m (fp16), 16 bytes of 4-bit codes
Q8_0_BLOCK_BYTES = 34           # GGUF Q8_0: d (fp16), 32 int8 codes
# "q4_k_i8" (linear_i8.c's Q4K_I8): a super-block of 8 blocks of 16 columns: d, dmin (fp16), the
# 6-bit scales and minimums a byte each, then the codes
Q4_K_I8_SUPER_BYTES = 2 * 2 * PANEL + 2 * 8 * PANEL + 8 * QBLOCK * PANEL // 2
# linear.c's enum layout; "_i8": the int8 dot-product forms against per-row quantized activations
# ("_i8h": with the scales kept as fp16, where every one is a half's)
LAYOUTS = {"f32": 0, "q4_1": 1, "q8_0": 2, "q4_1_i8": 3, "q8_0_i8": 4, "u8_i8": 5, "bf16": 6,
           "q4_1_i8h": 7, "q8_0_i8h": 8, "u8_i8h": 9, "u8s_i8": 10, "q4_k_i8": 11}
ROW_LAYOUTS = ("f32", "bf16", "q8_0", "q8_0_i8", "q8_0_i8h")  # layouts `weight_rows` reads back
# GGUF block types kept quantized, each read into the codes and scales of one kernel family:
# "q4_1" (w = d * q + m, q in 0..15, per 32 k), "q8_0" (w = d * q, q an int8, per 32 k), "u8"
# (w = d * q + m, q in 0..63, d and m per 16 k; only the int8 form runs it)
GGUF_FAMILIES = {"q4_0": "q4_1", "q4_1": "q4_1", "q4_k": "q4_1", "q8_0": "q8_0", "q5_0": "q8_0",
                 "q5_1": "u8", "q5_k": "u8", "q6_k": "u8"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib() -> ctypes.CDLL:
    return bind(library("linear"))


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A build of linear.c with its functions' signatures set (`benchmarks/linear_ab.py` binds
    two builds)."""
    lib.linear_pack.restype = None
    lib.linear_pack.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.linear_pack_bf16.restype = None
    lib.linear_pack_bf16.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.linear_pack_quantized.restype = None
    lib.linear_pack_quantized.argtypes = [ctypes.c_int, _ptr, _ptr, _ptr, _i64, _i64, _ptr]
    lib.linear_pack_q4k.restype = None
    lib.linear_pack_q4k.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr]
    lib.linear_rows.restype = None
    lib.linear_rows.argtypes = [_ptr, ctypes.c_int, _i64, _ptr, _i64, _ptr]
    lib.linear_forward.restype = ctypes.c_int
    lib.linear_forward.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int, _i64, _ptr, _ptr,
                                   ctypes.c_int]
    return lib


@functools.cache
def c_kernel_available() -> bool:
    """The C kernel builds and loads here (logged once where it does not)."""
    try:
        _lib()
    except BuildError as exc:
        logger.warning("C linear kernel unavailable (%s); float32 linears run oneDNN", exc)
        return False
    return True


def packing_available(dtype: torch.dtype) -> bool:
    """Weights of `dtype` can be packed here: float32 always (C, or oneDNN), bfloat16 where
    oneDNN has a prepacked bf16 GEMM (AVX512-BF16 or AMX)."""
    if dtype == torch.float32:
        return c_kernel_available() or torch.backends.mkldnn.is_available()
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class PackedWeight:
    """data: "f32": [ceil(out / 16), in, 16] float32 panels ("bf16": int16, their upper halves);
    "q4_1", "q8_0" and the "_i8" layouts: [ceil(out / 16), in / 32, block bytes] uint8 panels
    of GGUF codes and scales (linear.c, linear_i8.c); "onednn": oneDNN's blocked tensor."""
    data: torch.Tensor
    out_features: int
    in_features: int
    layout: str

    @property
    def onednn(self) -> bool:
        return self.layout == "onednn"


def pack(weight: torch.Tensor) -> PackedWeight:
    """An [out, in] weight of a dtype `packing_available` accepts, packed for `linear`. A float32
    weight whose every value is a bfloat16's (a bf16 checkpoint served in float32) packs into
    bf16 panels: the kernel widens each weight back exactly, so the products are the float32
    panels' bit for bit, from half the bytes."""
    out_features, in_features = weight.shape
    if weight.dtype == torch.float32 and c_kernel_available():
        w = weight.detach().contiguous()
        panels = -(-out_features // PANEL)
        if torch.equal(w.bfloat16().float(), w):
            data = torch.empty(panels, in_features, PANEL, dtype=torch.int16)
            _lib().linear_pack_bf16(w.data_ptr(), out_features, in_features, data.data_ptr())
            return PackedWeight(data, out_features, in_features, "bf16")
        data = torch.empty(panels, in_features, PANEL)
        _lib().linear_pack(w.data_ptr(), out_features, in_features, data.data_ptr())
        return PackedWeight(data, out_features, in_features, "f32")
    data = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
    return PackedWeight(data, out_features, in_features, "onednn")


def q4_1_codes(blocks: torch.Tensor, in_features: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 blocks [out, in / 32 * 20] uint8 -> (codes [out, in] uint8 in 0..15, d, m [out,
    in / 32] float32): the weight is (d * code) + m per block, as gguf dequantizes it."""
    out_features = blocks.shape[0]
    b = blocks.reshape(out_features, in_features // QBLOCK, Q4_1_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    qs = b[..., 4:]                                       # element j low, element j + 16 high
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(out_features, in_features)
    return codes, d, m


def q8_0_codes(blocks: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 blocks [out, in / 32 * 34] uint8 -> (codes [out, in] int8, d [out, in / 32]
    float32): the weight is d * code per block, as gguf dequantizes it."""
    out_features = blocks.shape[0]
    b = blocks.reshape(out_features, in_features // QBLOCK, Q8_0_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    codes = b[..., 2:].contiguous().view(torch.int8).reshape(out_features, in_features)
    return codes, d


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [..., 1] float32: a float16 field of each block."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones (GGUF's order)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> the 8 sub-blocks' 6-bit scales and minimums."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def gguf_codes(kind: str, blocks: torch.Tensor, in_features: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF blocks of type `kind` [out, bytes] uint8 -> their family's codes [out, in] and scales
    (`GGUF_FAMILIES`): d, m [out, in / 32] ("q4_1"; "q8_0": m None) or [out, in / 16] ("u8"),
    float32, with the weight d * q + m as gguf dequantizes it (the scales' products d * sc
    computed as gguf computes them)."""
    out = blocks.shape[0]
    b = blocks.numpy().reshape(out, -1)
    if kind == "q4_1":
        return q4_1_codes(blocks, in_features)
    if kind == "q8_0":
        return (*q8_0_codes(blocks, in_features), None)
    if kind == "q4_0":                                   # 2 d, 16 qs; w = d * (q - 8)
        b = b.reshape(out, -1, 18)
        d = _f16(b[..., 0:2])
        codes, m = _nibbles(b[..., 2:]), -8.0 * d
    elif kind in ("q5_0", "q5_1"):                       # d (m), 4 qh, 16 qs
        b = b.reshape(out, -1, 22 if kind == "q5_0" else 24)
        d = _f16(b[..., 0:2])
        at = 2 if kind == "q5_0" else 4
        m = -16.0 * d if kind == "q5_0" else _f16(b[..., 2:4])
        qh = np.ascontiguousarray(b[..., at:at + 4]).view(np.uint32)
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1
        codes = _nibbles(b[..., at + 4:]) | (high.astype(np.uint8) << 4)
        if kind == "q5_0":              # w = d * (c - 16): the Q8_0 family's int8 code c - 16
            return (torch.from_numpy(np.ascontiguousarray(
                        (codes.astype(np.int16) - 16).astype(np.int8).reshape(out, in_features))),
                    torch.from_numpy(np.ascontiguousarray(d.reshape(out, -1), dtype=np.float32)),
                    None)
        d, m = np.repeat(d, 2, -1), np.repeat(m, 2, -1)         # per half block
    elif kind in ("q4_k", "q5_k"):                       # d, dmin, 12 scales, (32 qh), 128 qs
        b = b.reshape(out, -1, 144 if kind == "q4_k" else 176)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(*b.shape[:2], 4, 32)
        codes = _nibbles(qs).reshape(*b.shape[:2], 8, 32)      # sub-block 2i low, 2i + 1 high
        if kind == "q5_k":
            qh = b[..., 16:48]
            codes = codes | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1)
                             << 4)
        d, m = d * sc, -(dmin * mn)                                  # [out, super, 8]
        if kind == "q5_k":
            d, m = np.repeat(d, 2, -1), np.repeat(m, 2, -1)
    elif kind == "q6_k":                                 # 128 ql, 64 qh, 16 scales, d
        b = b.reshape(out, -1, 210)
        ql = b[..., 0:128].reshape(*b.shape[:2], 2, 64)
        ql = np.concatenate((ql & 0x0F, ql >> 4), axis=-1).reshape(*b.shape[:2], 8, 32)
        qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)
        qh = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(
            *b.shape[:2], 8, 32)
        codes = ql | (qh << 4)                                         # q + 32, in 0..63
        d = _f16(b[..., 208:210]) * np.ascontiguousarray(b[..., 192:208]).view(
            np.int8).astype(np.float32)                                # per 16 k
        m = -32.0 * d
    else:
        raise ValueError(f"GGUF type {kind} is not kept quantized")
    return (torch.from_numpy(np.ascontiguousarray(codes.reshape(out, in_features))),
            torch.from_numpy(np.ascontiguousarray(d.reshape(out, -1), dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(m.reshape(out, -1), dtype=np.float32)))


def pack_gguf(kind: str, blocks: torch.Tensor, in_features: int, int8: bool = False
              ) -> PackedWeight | None:
    """GGUF blocks of type `kind` (rows in the model's order) packed for the C kernel, which
    dequantizes them in registers (float32 activations) or, `int8`, sums their codes against the
    activations quantized to int8 per row (`linear_i8.c`); None where only the int8 form reads
    the type (the "u8" family with float32 activations). Needs `c_kernel_available()`."""
    family = GGUF_FAMILIES[kind]
    if family == "u8" and not int8:
        return None
    if int8 and kind == "q4_k":
        return pack_q4_k(blocks, in_features)
    codes, d, m = gguf_codes(kind, blocks, in_features)
    return pack_codes(family, codes, d, m) if not int8 else pack_int8(family, codes, d, m)


def pack_q4_k(blocks: torch.Tensor, in_features: int) -> PackedWeight:
    """GGUF Q4_K blocks in their own int8 layout ("q4_k_i8", `linear_i8.c`): each super-block's
    fp16 d and dmin and its sub-blocks' 6-bit scales and minimums as the file has them, the
    products d * sc and dmin * mn formed in the kernel (gguf's float32 products): 296 bytes a
    block of 16 columns by 32 k, against 384 with the products stored as float32."""
    out = blocks.shape[0]
    b = blocks.numpy().reshape(out, -1, 144)
    sc, mn = _k_scales(b[..., 4:16])                                   # [out, super, 8]
    codes = _nibbles(b[..., -128:].reshape(*b.shape[:2], 4, 32))
    arrays = [np.ascontiguousarray(a) for a in (
        codes.reshape(out, in_features), b[..., 0:2].view(np.uint16)[..., 0],
        b[..., 2:4].view(np.uint16)[..., 0], sc.astype(np.uint8).reshape(out, -1),
        mn.astype(np.uint8).reshape(out, -1))]
    data = torch.empty(-(-out // PANEL), in_features // QBLOCK, Q4_K_I8_SUPER_BYTES // 8,
                       dtype=torch.uint8)
    _lib().linear_pack_q4k(*[a.ctypes.data for a in arrays], out, in_features,
                           data.data_ptr())
    return PackedWeight(data, out, in_features, "q4_k_i8")


def pack_int8(family: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
              ) -> PackedWeight:
    """A family's codes and scales in its int8 layout: with the scales as fp16 ("_i8h") where
    every one is a half's (Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store them so, m = -8 d or -16 d
    included), else as float32 (a K-quant's, the products of two scales), without m where
    m = -32 d (Q6_K: "u8s_i8")."""
    if all(s is None or torch.equal(s.half().float(), s) for s in (d, m)):
        return pack_codes(f"{family}_i8h", codes, d.half(), None if m is None else m.half())
    if family == "u8" and torch.equal(m, -32.0 * d):        # Q6_K: m left to the kernel
        return pack_codes("u8s_i8", codes, d, None)
    return pack_codes(f"{family}_i8", codes, d, m)


def pack_gguf_parts(parts: list[tuple[str, torch.Tensor]], in_features: int, int8: bool = False
                    ) -> PackedWeight | None:
    """The stacked parts of a fused weight (q, k, v; gate, up) whose GGUF types differ (Q4_K q and
    k beside a Q6_K v, as Q4_K_M files have them): their codes in the one family that holds them
    all, int8 form only: "q8_0" where every part is Q8_0, Q5_0 or Q4_0 (a Q4_0 code less 8 is a
    Q8_0 code: a small model's Q4_K_M file, whose rows that are not a multiple of 256
    llama-quantize writes as Q5_0, has a Q8_0 v beside them), else "u8" (4- and 5-bit codes fit;
    a block's d and m serve both its halves); None where that cannot be (float32 activations,
    or a Q8_0 part beside an asymmetric one)."""
    if not int8:
        return None
    codes, d, m = [], [], []
    if all(GGUF_FAMILIES[kind] == "q8_0" or kind == "q4_0" for kind, _ in parts):
        for kind, blocks in parts:
            c, dd, _ = gguf_codes(kind, blocks, in_features)
            codes.append(c.to(torch.int16) - 8 if kind == "q4_0" else c), d.append(dd)
        return pack_int8("q8_0", torch.cat(codes).to(torch.int8), torch.cat(d), None)
    if any(kind == "q8_0" for kind, _ in parts):
        return None
    for kind, blocks in parts:
        c, dd, mm = gguf_codes(kind, blocks, in_features)
        if kind == "q5_0":                                # int8 c - 16 -> c in 0..31, m = -16 d
            c, mm = (c.to(torch.int16) + 16).to(torch.uint8), -16.0 * dd
        if GGUF_FAMILIES[kind] != "u8":                       # per 32 k -> per half block
            dd, mm = dd.repeat_interleave(2, 1), mm.repeat_interleave(2, 1)
        codes.append(c), d.append(dd), m.append(mm)
    return pack_int8("u8", torch.cat(codes), torch.cat(d), torch.cat(m))


def pack_codes(layout: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
                ) -> PackedWeight:
    """A family's codes [out, in] and scales (`gguf_codes`) packed in `layout` (`LAYOUTS`): the
    scales float32, or float16 for the "_i8h" layouts."""
    want = torch.float16 if layout.endswith("_i8h") else torch.float32
    if d.dtype != want or (m is not None and m.dtype != want):
        raise ValueError(f"{layout} panels take {want} scales, not {d.dtype}")
    out_features, in_features = codes.shape
    scale_bytes = PANEL * d.element_size()           # a block's d (or m) of its 16 columns
    block_bytes = {"q4_1": 2 * scale_bytes + QBLOCK * PANEL // 2,
                   "q8_0": scale_bytes + QBLOCK * PANEL,
                   "u8": 4 * scale_bytes + QBLOCK * PANEL,
                   "u8s": 2 * scale_bytes + QBLOCK * PANEL}[layout.split("_i8")[0]]
    data = torch.empty(-(-out_features // PANEL), in_features // QBLOCK, block_bytes,
                       dtype=torch.uint8)
    codes, d = codes.contiguous(), d.contiguous()
    m = None if m is None else m.contiguous()
    _lib().linear_pack_quantized(LAYOUTS[layout], codes.data_ptr(), d.data_ptr(),
                                 None if m is None else m.data_ptr(), out_features,
                                 in_features, data.data_ptr())
    return PackedWeight(data, out_features, in_features, layout)


def pack_q4_1(blocks: torch.Tensor, in_features: int, int8: bool = False) -> PackedWeight:
    """GGUF Q4_1 blocks [out, in / 32 * 20] uint8 packed (`pack_gguf`)."""
    return pack_gguf("q4_1", blocks, in_features, int8)


def pack_q8_0(blocks: torch.Tensor, in_features: int, int8: bool = False) -> PackedWeight:
    """GGUF Q8_0 blocks [out, in / 32 * 34] uint8 packed (`pack_gguf`)."""
    return pack_gguf("q8_0", blocks, in_features, int8)


# A panel's bytes per block (or per k for "f32" and "bf16") as stripes of PANEL * width bytes, in
# which output c of the panel owns bytes [c * width, (c + 1) * width): (stripes, width) in order
# (scales as float32 or fp16, then the codes' 64-byte rows of 4 k an output; "q4_k_i8" a
# super-block: d and dmin, the scales and minimums a byte each, then 8 blocks' codes)
STRIPES = {"f32": [(1, 4)], "bf16": [(1, 2)], "q8_0": [(1, 4), (32, 1)],
           "q4_1_i8": [(6, 4)], "q8_0_i8": [(9, 4)],
           "u8_i8": [(12, 4)], "q4_1_i8h": [(2, 2), (4, 4)], "q8_0_i8h": [(1, 2), (8, 4)],
           "u8_i8h": [(4, 2), (8, 4)], "u8s_i8": [(10, 4)],
           "q4_k_i8": [(2, 2), (16, 1), (32, 4)]}


def select_outputs(packed: PackedWeight, ids: torch.Tensor) -> PackedWeight | None:
    """The outputs ids (int64 [n]) of a packed weight as a packed weight of their own, in ids'
    order, each output's bytes copied as they are (`STRIPES`): its outputs are the full weight's
    at ids, bit for bit (VeriCache's draft vocabulary). None for a layout without stripes."""
    if packed.layout not in STRIPES:
        return None
    unit = (Q4_K_I8_SUPER_BYTES if packed.layout == "q4_k_i8"     # a block's (k's) bytes a panel
            else packed.data[0, 0].nbytes)
    src = packed.data.view(torch.uint8).reshape(packed.data.shape[0], -1, unit)
    n = len(ids)
    panels, units = -(-n // PANEL), src.shape[1]
    ids = torch.cat([ids, ids[-1:].expand(panels * PANEL - n)]) if n % PANEL else ids
    p, c = ids // PANEL, ids % PANEL
    parts, at = [], 0
    for count, width in STRIPES[packed.layout]:
        seg = src[:, :, at:at + count * PANEL * width].reshape(-1, units, count, PANEL, width)
        picked = seg[p, :, :, c, :]                                   # [n', units, count, width]
        parts.append(picked.reshape(panels, PANEL, units, count, width).permute(0, 2, 3, 1, 4)
                     .reshape(panels, units, count * PANEL * width))
        at += count * PANEL * width
    data = torch.cat(parts, dim=2).contiguous().view(packed.data.dtype)
    return PackedWeight(data.reshape(panels, *packed.data.shape[1:]), n, packed.in_features,
                        packed.layout)


def weight_rows(packed: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a C-packed weight (`ROW_LAYOUTS`), exactly the (dequantized) weight's:
    [len(rows), in] (a tied embedding's lookup read from the packed LM head, so the matrix is held
    once)."""
    if packed.layout not in ROW_LAYOUTS:
        raise ValueError(f"weight_rows reads {ROW_LAYOUTS} panels, not {packed.layout}")
    rows = rows.to(torch.int64).contiguous()
    if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < packed.out_features):
        raise IndexError(f"weight rows out of range [0, {packed.out_features})")
    out = torch.empty(len(rows), packed.in_features)
    _lib().linear_rows(packed.data.data_ptr(), LAYOUTS[packed.layout], packed.in_features,
                       rows.data_ptr(), len(rows), out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype (the weight's)."""
    if packed.onednn:
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    rows = x.reshape(-1, packed.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.out_features)
    linear_into(rows, packed, None if bias is None else bias.contiguous(), out)
    return out.view(*x.shape[:-1], packed.out_features)


def linear_into(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None,
                out: torch.Tensor) -> None:
    """The C kernel on contiguous float32 x [rows, in] into a preallocated contiguous out [rows,
    out] (a C-packed weight: not oneDNN's)."""
    status = _lib().linear_forward(x.data_ptr(), x.shape[0], packed.in_features,
                                   packed.data.data_ptr(), LAYOUTS[packed.layout],
                                   packed.out_features, None if bias is None else bias.data_ptr(),
                                   out.data_ptr(), torch.get_num_threads())
    if status:
        raise MemoryError(f"linear kernel: no memory for {x.shape[0]} rows' block sums")
