"""Speculation is lossless only where a row's result cannot depend on which rows share its step:
configurations that run PyTorch's or oneDNN's shape-dependent kernels on the CPU refuse
speculation in one line at start-up (and still serve without it)."""
from __future__ import annotations

import pytest

from specserve.scheduler.config import SpeculativeConfig
from specserve.spec_phases import cpu_decoder

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def test_the_c_kernels_keep_rows_independent(make_engine):
    core = make_engine(device="cpu", dtype="float32", speculative=NGRAM)
    assert cpu_decoder.batch_dependence(core.worker.model) is None
    assert core.worker.proposer is not None


def test_pytorch_gemm_refuses_speculation(make_engine):
    with pytest.raises(ValueError, match="PyTorch's GEMM.*serve without --speculative-config"):
        make_engine(device="cpu", dtype="float32", cpu_weight_packing=False, speculative=NGRAM)
    plain = make_engine(device="cpu", dtype="float32", cpu_weight_packing=False)
    assert cpu_decoder.batch_dependence(plain.worker.model) is not None


def test_reference_kernels_refuse_speculation(make_engine, monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNELS", "reference")
    with pytest.raises(ValueError, match="SPECSERVE_KERNELS=reference"):
        make_engine(device="cpu", dtype="float32", speculative=NGRAM)


def test_no_compiler_refuses_speculation(make_engine, monkeypatch, tmp_path):
    from specserve.kernels.cpu import linear, native
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.library.cache_clear()
    linear.c_kernel_available.cache_clear()
    try:
        with pytest.raises(ValueError, match="serve without --speculative-config"):
            make_engine(device="cpu", dtype="float32", speculative=NGRAM)
    finally:
        native.library.cache_clear()
        linear.c_kernel_available.cache_clear()
