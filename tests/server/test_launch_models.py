"""MODEL on `specserve serve`: local paths, Hub ids read from a local Hugging Face cache (never the
network), and one-line refusals with exit status 2 for what cannot be served.

The cache is laid out in a tmp folder the way huggingface_hub lays it out (its own
`repo_folder_name`; `refs/<branch or tag>` holding a commit; `snapshots/<commit>/...`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.file_download import repo_folder_name

from specserve.server.cli import build_parser, main, serve_launch
from specserve.spec_phases.paths import ModelPathError, describe_model, resolve_model_path

REPO = "tiny-org/tiny-llama"
COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def fake_hub_cache(cache: Path, repo: str = REPO) -> Path:
    """A cached model repo with two snapshots: `main` and tag `v1`."""
    root = cache / repo_folder_name(repo_id=repo, repo_type="model")
    for ref, commit, layers in (("main", COMMIT_MAIN, 2), ("v1", COMMIT_V1, 1)):
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": layers}))
    return root


def refusal(argv, capsys) -> str:
    """Run the CLI; it must exit 2 with exactly one line on stderr and no traceback."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("specserve: error: ")
    return lines[0]


def test_a_missing_path_is_one_line(capsys, tmp_path):
    line = refusal(["serve", str(tmp_path / "nothing-here")], capsys)
    assert "nothing-here" in line and "no such file or folder" in line


def test_a_folder_without_config_json_is_one_line(capsys, tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    line = refusal(["serve", str(tmp_path)], capsys)
    assert "has no config.json" in line


def test_a_file_that_is_not_gguf_is_one_line(capsys, tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0")
    line = refusal(["serve", str(path)], capsys)
    assert "not a .gguf file" in line


def test_a_hub_id_not_in_the_cache_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = refusal(["serve", "nobody/not-cached", "--download-dir", str(tmp_path)], capsys)
    assert "'nobody/not-cached'" in line and "not in the local Hugging Face cache" in line
    assert str(tmp_path) in line


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path):
    root = fake_hub_cache(tmp_path)
    path = resolve_model_path(REPO, download_dir=str(tmp_path))
    assert path == root / "snapshots" / COMMIT_MAIN
    assert describe_model(path) == "LlamaForCausalLM"


def test_revision_picks_a_tag_or_a_commit_and_an_uncached_one_is_refused(tmp_path):
    root = fake_hub_cache(tmp_path)
    assert resolve_model_path(REPO, "v1", str(tmp_path)) == root / "snapshots" / COMMIT_V1
    assert resolve_model_path(REPO, COMMIT_MAIN, str(tmp_path)) == root / "snapshots" / COMMIT_MAIN
    with pytest.raises(ModelPathError, match="at revision 'v2'"):
        resolve_model_path(REPO, "v2", str(tmp_path))


def test_hf_home_locates_the_cache(tmp_path):
    """HF_HOME (read by huggingface_hub at import) is where a Hub id is looked up."""
    root = fake_hub_cache(tmp_path / "hub")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", "from specserve.spec_phases.paths import resolve_model_path; "
                               f"print(resolve_model_path({REPO!r}))"],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(root / "snapshots" / COMMIT_MAIN)


def test_serve_launch_hands_the_engine_the_snapshot_and_keeps_the_hub_id_as_name(tmp_path):
    root = fake_hub_cache(tmp_path)
    args = build_parser().parse_args(["serve", REPO, "--download-dir", str(tmp_path)])
    config, path, tokenizer, defaults = serve_launch(args)
    assert config.model == str(root / "snapshots" / COMMIT_MAIN) == str(path)
    assert tokenizer is None and defaults == {}
    assert args.model == REPO                     # the served name stays the Hub id


def test_a_local_path_that_looks_like_a_hub_id_is_read_locally(tmp_path, monkeypatch):
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == Path("org/name")


def test_a_folder_with_one_gguf_file_serves_it(tmp_path):
    (tmp_path / "m.Q4_0.gguf").write_bytes(b"")
    assert resolve_model_path(str(tmp_path)) == tmp_path / "m.Q4_0.gguf"
    (tmp_path / "m.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(ModelPathError, match="2 .gguf files"):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize("error", [
    ValueError("Model architectures ['FooForCausalLM'] are not supported; supported: [...]"),
    FileNotFoundError("model.safetensors is missing from /models/x")])
def test_the_engine_refusing_a_model_is_one_line_exit_2(capsys, monkeypatch, error):
    """What the loader refuses (an unsupported architecture, a missing weight file) reaches the
    operator as its one-line reason and exit status 2."""
    import specserve.scheduler.async_engine as async_engine

    def refuse_model(config, process=True, warm_up=False):
        raise error
    monkeypatch.setattr(async_engine, "AsyncEngine", refuse_model)
    line = refusal(["serve", "--engine-in-thread"], capsys)
    assert line == f"specserve: error: {error}"


def test_a_refusal_in_the_engine_process_keeps_its_kind(tmp_path):
    """The engine process reports a start-up refusal by its base class, so the CLI can tell a
    refused model (ValueError, FileNotFoundError) from a crash (RuntimeError)."""
    from specserve.scheduler.async_engine import ProcessHost
    from specserve.scheduler.config import EngineConfig

    missing = tmp_path / "gone.gguf"
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        ProcessHost(EngineConfig(model=str(missing)), on_event=lambda event: None,
                    warm_up=False)


def test_serve_a_hub_id_from_the_cache_end_to_end(tmp_path, tokenizer, wait_healthy):
    """`specserve serve org/name` with HF_HOME pointing at a cache that holds a tiny Llama written
    by transformers: it starts offline, serves under the Hub id, and applies the snapshot's
    generation_config.json."""
    import socket
    import time

    import httpx
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path / "hub" / repo_folder_name(repo_id="tiny-org/served", repo_type="model")
    snap = root / "snapshots" / COMMIT_MAIN
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(str(snap))
    tokenizer.save_pretrained(str(snap))
    (snap / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}')
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT_MAIN)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.server", "serve", "tiny-org/served", "--port",
             str(port), "--host", "127.0.0.1", "--engine-in-thread", "--num-threads", "1",
             "--kv-cache-memory-gb", "0.01"], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-org/served"
        reply = httpx.post(url + "/v1/completions", json={
            "model": "tiny-org/served", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
            timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert "model tiny-org/served (" in text and "architecture LlamaForCausalLM" in text
    assert "sampling defaults {'temperature': 0.6}" in text
