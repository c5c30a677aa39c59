"""Peer runners: start/ready/stop of a real child process on 127.0.0.1, the install marker,
commands."""
import json
import sys

import pytest

from loadtests import peers
from loadtests.peers import Peer, ensure_venv, free_port

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": [{"id": "m"}]}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_peer_starts_answers_and_stops(tmp_path):
    port = free_port()
    peer = Peer("fake", [sys.executable, "-c", SERVER, str(port)], port, startup_timeout_s=30)
    peer.start(tmp_path)
    try:
        peer.wait_ready()
        assert peer.proc.poll() is None
    finally:
        peer.stop(grace_s=5)
    assert peer.proc.poll() is not None
    assert peer.log_path.read_text().startswith("$ ")


def test_peer_that_exits_reports_its_log(tmp_path):
    peer = Peer("dies", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                free_port(),
                startup_timeout_s=30)
    peer.start(tmp_path)
    with pytest.raises(RuntimeError, match="exited with 3"):
        peer.wait_ready()
    assert peer.last_log_line() == "no model here"


def test_ensure_venv_skips_when_marker_matches(tmp_path, monkeypatch):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".installed").write_text(json.dumps([["install", "x"]]))
    calls = []
    monkeypatch.setattr(peers, "_run", lambda cmd, log, env=None: calls.append(cmd))
    assert ensure_venv(venv, [["install", "x"]]) == venv / "bin" / "python"
    assert calls == []
    ensure_venv(venv, [["install", "x"], ["install", "y"]])        # a changed recipe reinstalls
    assert ([c[-1] for c in calls] == ["x", "y"]
            and all(c[:3] == ["nice", "-n", "19"] for c in calls))
    assert json.loads((venv / ".installed").read_text())[-1] == ["install", "y"]


def test_peer_commands_match_the_comparison(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_PEERS_DIR", str(tmp_path))
    monkeypatch.setattr(peers, "export_hf_model", lambda: tmp_path / "hf-model")
    monkeypatch.setattr(peers, "embedded_gguf", lambda: tmp_path / "m.gguf")
    ngram = peers.vllm_peer(9001, ngram=True)
    spec = json.loads(ngram.cmd[ngram.cmd.index("--speculative-config") + 1])
    assert spec == peers.NGRAM_CONFIG and ngram.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert ngram.cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    plain = peers.vllm_peer(9002, ngram=False)
    assert "--speculative-config" not in plain.cmd
    assert plain.cmd[plain.cmd.index("--dtype") + 1] == "bfloat16" and plain.name == "vllm-cpu"
    fp32 = peers.vllm_peer(9005, ngram=True, dtype="float32")
    assert fp32.cmd[fp32.cmd.index("--dtype") + 1] == "float32"
    assert fp32.name == "vllm-cpu-fp32-ngram"
    llama = peers.llama_server_peer(9003, num_slots=8, ctx_per_slot=2048)
    assert llama.cmd[0] == str(tmp_path / "llama.cpp" / "llama-server")
    flag = {k: v for k, v in zip(llama.cmd, llama.cmd[1:])}
    assert flag["--parallel"] == "8" and flag["--ctx-size"] == str(8 * 2048)   # a slot a request
    assert flag["--threads"] == flag["--threads-batch"] == "2" and flag["--model"].endswith(".gguf")
    assert "--no-repack" in llama.cmd and "--cont-batching" in llama.cmd
    assert llama.extra_body == {"ignore_eos": True} and flag["--alias"] == peers.SERVED_MODEL_NAME
    ours = peers.specserve_peer(9004, mode="ngram")
    assert json.loads(ours.cmd[ours.cmd.index("--speculative-config") + 1]) == peers.NGRAM_CONFIG
    assert "--host" in ours.cmd and ours.cmd[ours.cmd.index("--host") + 1] == "127.0.0.1"


def test_llama_server_build_runs_once_per_recipe(tmp_path, monkeypatch):
    """The sdist is downloaded and unpacked, its vendored llama.cpp configured and built (niced,
    two jobs), the binaries copied out; a matching marker skips all of it."""
    import io
    import tarfile

    top = f"llama_cpp_python-{peers.LLAMA_CPP_PYTHON_VERSION}"
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / f"{top}.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo(f"{top}/vendor/llama.cpp/CMakeLists.txt")
        tar.addfile(info, io.BytesIO(b""))
    calls = []

    def fake_run(cmd, log, env=None):                 # "cmake --build" leaves the binaries
        calls.append(cmd)
        if "--build" in cmd:
            bin_dir = src / top / "vendor" / "llama.cpp" / "build" / "bin"
            bin_dir.mkdir(parents=True)
            for target in peers.LLAMA_TARGETS:
                (bin_dir / target).write_text(target)
    monkeypatch.setattr(peers, "_run", fake_run)
    out = peers.install_llama_server(tmp_path)
    assert out == tmp_path / "llama.cpp" and (out / "llama-server").read_text() == "llama-server"
    assert (out / "llama-quantize").exists()
    download, configure, build = calls
    assert download[-5:] == ["--no-binary", ":all:", "llama-cpp-python==0.3.36", "-d", str(src)]
    assert configure[:2] == ["cmake", "-S"] and configure[2].endswith("vendor/llama.cpp")
    assert "-DGGML_NATIVE=ON" in configure and "-DLLAMA_BUILD_SERVER=ON" in configure
    assert build[:3] == ["nice", "-n", "19"] and build[-3:] == [*peers.LLAMA_TARGETS, "-j2"]
    calls.clear()
    assert peers.install_llama_server(tmp_path) == out and calls == []
