"""What the HTTP process imports: with the engine core in its own process the server never needs
torch to validate, route or stream (start-up and memory: ~2 s and ~180 MB on a small host), and a
CPU-only engine never imports triton. Each check runs in a fresh interpreter."""
import subprocess
import sys


def modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return set(out.split())


def test_the_http_side_imports_no_torch():
    loaded = modules_after("import specserve.server.app, specserve.server.cli, "
                           "specserve.scheduler.async_engine, specserve.scheduler.validation")
    assert "specserve.server.app" in loaded
    assert "torch" not in loaded


def test_a_cpu_op_imports_no_triton():
    loaded = modules_after("import torch\nfrom specserve.kernels.dispatch import get_op\n"
                           "x = torch.randn(3, 8)\n"
                           "get_op('rms_norm', 'cpu')(x, torch.ones(8), 1e-6)")
    assert "specserve.kernels.dispatch" in loaded
    assert "triton" not in loaded
