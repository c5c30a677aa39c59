"""vLLM launch flags: docs/vllm-flags.md is read here and every row's fragment is run through the
parser and the launch checks (honoured: no refusal; refused: exit with one line), so the table and
the code cannot drift. Then what the honoured HTTP/log flags do, checked on a running app."""
import json
import logging
import re
from pathlib import Path

import httpx
import pytest

from huggingface_hub import constants as hub_constants
from huggingface_hub.file_download import repo_folder_name

from specserve.server.cli import (build_parser, expand_config_file, serve_launch,
                                  uvicorn_config)

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "vllm-flags.md"
ROW = re.compile(r"^\| `([^`]+)`[^|]*\| (honoured|refused) \|")
# the flags the issue names: each must have a row
ISSUE_FLAGS = ["--gpu-memory-utilization", "--tensor-parallel-size", "--tokenizer",
               "--trust-remote-code", "--generation-config", "--enforce-eager", "--kv-cache-dtype",
               "--enable-chunked-prefill", "--disable-uvicorn-access-log", "--enable-log-requests",
               "--root-path", "--allowed-origins", "--ssl-keyfile", "--max-log-len", "--config",
               "--load-format", "--quantization", "--revision", "--download-dir"]


def table_rows() -> list[tuple[str, str]]:
    rows = [m.groups() for line in TABLE.read_text().splitlines() if (m := ROW.match(line))]
    assert len(rows) > 60
    return rows


@pytest.fixture
def launch_dir(tmp_path, monkeypatch):
    """The files the table's fragments name, and a Hub cache holding the id it names."""
    (tmp_path / "key.pem").write_text("key")
    (tmp_path / "cert.pem").write_text("cert")
    (tmp_path / "launch.yaml").write_text("max_num_seqs: 8\nenforce_eager: true\n")
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.8}')
    (gen / "template.jinja").write_text("{{ messages }}")
    hub = tmp_path / "hub"
    snap = hub / repo_folder_name(repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                                  repo_type="model") / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("c" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def launch(fragment: str):
    parser = build_parser()
    argv = expand_config_file(["serve", *fragment.split()], parser)
    return serve_launch(parser.parse_args(argv))


@pytest.mark.parametrize("fragment, verdict", table_rows())
def test_every_row_of_the_table_holds(fragment, verdict, launch_dir, capsys):
    if verdict == "honoured":
        launch(fragment)
        return
    with pytest.raises(SystemExit) as info:
        launch(fragment)
    code = info.value.code
    if code == 2:                        # argparse / launch refusal: one line on stderr
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0], lines
    else:                                # EngineConfig refusal: the message is the exit code
        assert isinstance(code, str) and code.startswith("specserve:") and "\n" not in code


def listed_flags() -> set[str]:
    return {word for fragment, _ in table_rows() for word in fragment.split()
            if word.startswith("-")}


def test_the_issue_flags_all_have_rows():
    missing = [flag for flag in ISSUE_FLAGS if flag not in listed_flags()]
    assert not missing, missing


def test_every_vllm_flag_the_parser_declares_has_a_row():
    """The other direction: a flag added to add_vllm_flags must be put in the table too."""
    import argparse

    from specserve.server.cli import add_vllm_flags
    parser = argparse.ArgumentParser()
    add_vllm_flags(parser)
    declared = {opt for action in parser._actions for opt in action.option_strings
                if opt.startswith("--") and opt != "--help"}
    missing = sorted(declared - listed_flags())
    assert not missing, missing


def test_the_table_is_linked_from_the_readme():
    assert "docs/vllm-flags.md" in (ROOT / "README.md").read_text()


def test_config_yaml_fills_flags_and_the_command_line_wins(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "model: tiny-random\nmax_num_seqs: 8\nmax-model-len: 256\nenable_prefix_caching: false\n"
        "served_model_name: [a, b]\nallowed_origins: ['https://x.example']\n"
        "disable_uvicorn_access_log: true\n")
    parser = build_parser()
    argv = expand_config_file(["serve", "--config", str(tmp_path / "c.yaml"),
                               "--max-num-seqs", "4"], parser)
    args = parser.parse_args(argv)
    assert args.model == "tiny-random"
    assert (args.max_num_seqs, args.max_model_len) == (4, 256)      # the command line wins
    assert args.enable_prefix_caching is False
    assert args.served_model_name == ["a", "b"]
    assert args.allowed_origins == ["https://x.example"]
    assert args.disable_uvicorn_access_log is True
    argv = expand_config_file(["serve", "other-model", f"--config={tmp_path / 'c.yaml'}"], parser)
    assert parser.parse_args(argv).model == "other-model"            # MODEL given: it wins


def test_config_yaml_with_an_unknown_key_is_one_line(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("max_num_seqz: 8\n")
    with pytest.raises(SystemExit) as info:
        expand_config_file(["serve", "--config", str(tmp_path / "c.yaml")], build_parser())
    assert info.value.code == 2
    assert "unknown key 'max_num_seqz'" in capsys.readouterr().err


def test_uvicorn_gets_tls_root_path_and_access_log(tmp_path):
    args = build_parser().parse_args([
        "serve", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem",
        "--ssl-cert-reqs", "2", "--root-path", "/llm", "--disable-uvicorn-access-log",
        "--uvicorn-log-level", "warning"])
    config = uvicorn_config(args, app=None)
    assert (config.ssl_keyfile, config.ssl_certfile, config.ssl_ca_certs) == \
        ("k.pem", "c.pem", "ca.pem")
    assert config.ssl_cert_reqs == 2 and config.root_path == "/llm"
    assert config.access_log is False and config.log_level == "warning"
    formats = [f["fmt"] for f in config.log_config["formatters"].values()]
    assert formats and all(fmt.startswith("%(asctime)s") for fmt in formats)


def test_gpu_memory_utilization_reaches_the_engine_config_and_cpu_kv_space_maps(monkeypatch):
    from specserve.server.cli import engine_config
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.85"])
    assert engine_config(args).gpu_memory_utilization == 0.85
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert engine_config(build_parser().parse_args(["serve"])).kv_cache_memory_gb == 3.0
    given = build_parser().parse_args(["serve", "--kv-cache-memory-gb", "0.5"])
    assert engine_config(given).kv_cache_memory_gb == 0.5          # the flag wins


def test_the_utilization_budget_arithmetic():
    from specserve.spec_phases.worker import ACTIVATION_RESERVE_GB, utilization_kv_budget
    gib = 2**30
    # 80 GiB device, 20 GiB in use after the weights: 0.9 x 80 - 20 - reserve
    assert utilization_kv_budget(0.9, 60 * gib, 80 * gib) == int(
        (72 - 20 - ACTIVATION_RESERVE_GB) * gib)
    with pytest.raises(ValueError, match="leaves no room"):
        utilization_kv_budget(0.25, 60 * gib, 80 * gib)


def test_gpu_memory_utilization_on_cpu_keeps_the_kv_budget(caplog):
    """On a CPU the flag does not size the cache (vLLM-CPU's rule); a log line says so."""
    from specserve.scheduler.config import EngineConfig
    from specserve.scheduler.engine import EngineCore
    base = dict(model="tiny-random", device="cpu", kv_cache_memory_gb=0.02, max_model_len=64)
    with caplog.at_level(logging.INFO):
        core = EngineCore(EngineConfig(gpu_memory_utilization=0.5, **base))
    assert core.engine_info.num_blocks == EngineCore(EngineConfig(**base)).engine_info.num_blocks
    assert any("does not apply on cpu" in r.getMessage() for r in caplog.records)


# -- honoured HTTP flags, on a running app -------------------------------------------------------
def settings_for(*flags):
    from specserve.server.cli import server_settings
    from specserve.server.settings import ServerSettings
    args = build_parser().parse_args(["serve", *flags])
    info = type("Info", (), {"name": "fake-model", "path": "/models/fake.gguf"})()
    settings = server_settings(args, info)
    assert isinstance(settings, ServerSettings)
    return settings


def test_cors_flags(make_server):
    from dataclasses import asdict
    settings = settings_for("--allowed-origins", '["https://app.example"]', "--allowed-methods",
                            '["POST"]', "--allowed-headers", '["Authorization"]',
                            "--allow-credentials", "--served-model-name", "fake-model")
    overrides = {k: v for k, v in asdict(settings).items() if k.startswith("cors_")}
    srv = make_server(**overrides)
    ok = httpx.options(srv.url + "/v1/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    bad = httpx.options(srv.url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 400
    assert "access-control-allow-origin" not in bad.headers


def test_disable_fastapi_docs(make_server):
    srv = make_server(enable_docs=False)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(srv.url + path).status_code == 404
    srv = make_server()
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(srv.url + path).status_code == 200


def test_enable_log_requests_and_max_log_len(make_server, caplog):
    body = json.dumps({"model": "fake-model", "prompt": "line one\n" + "x" * 500,
                       "max_tokens": 2}, indent=1)           # newlines in the body itself
    with caplog.at_level(logging.INFO, logger="specserve.server"):
        srv = make_server(log_requests=True, max_log_len=60)
        r = httpx.post(srv.url + "/v1/completions", content=body,
                       headers={"X-Request-Id": "req-42", "Content-Type": "application/json"})
        assert r.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("request req-42: POST /v1/completions ")
    assert line.endswith(f"... ({len(body)} chars)") and "x" * 500 not in line
    assert line.removeprefix("request req-42: POST /v1/completions ").startswith(
        body[:60].replace("\n", "\\n"))
    assert "\n" not in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specserve.server"):
        srv = make_server()                        # the default: not logged
        httpx.post(srv.url + "/v1/completions", content=body)
    assert not [r for r in caplog.records if r.getMessage().startswith("request ")]


def test_root_path_prefixes_the_docs_assets_and_schema(tokenizer, fake_engine):
    from fastapi.testclient import TestClient

    from specserve.server.app import build_app
    from specserve.server.settings import ServerSettings
    app = build_app(fake_engine, tokenizer, ServerSettings(served_model_names=("fake-model",)))
    with TestClient(app, root_path="/llm") as client:
        page = client.get("/docs").text
        assert "/llm/docs-assets/swagger-ui-bundle.js" in page and "'/llm/openapi.json'" in page
        assert "/llm/docs-assets/redoc.standalone.js" in client.get("/redoc").text


def test_tls_flags_serve_https(tmp_path, tokenizer, fake_engine):
    """--ssl-keyfile/--ssl-certfile: the server answers over HTTPS with that certificate."""
    import shutil
    import socket
    import ssl
    import subprocess
    import threading
    import time

    import uvicorn

    from specserve.server.app import build_app
    from specserve.server.settings import ServerSettings
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make the test certificate"
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", str(port),
                                      "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                                      "--uvicorn-log-level", "warning"])
    app = build_app(fake_engine, tokenizer, ServerSettings(served_model_names=("fake-model",)))
    server = uvicorn.Server(uvicorn_config(args, app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30              # a hang guard, not a timing assertion
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        trust = ssl.create_default_context(cafile=str(cert))
        reply = httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=trust)
        assert reply.status_code == 200 and reply.json()["data"][0]["id"] == "fake-model"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models")      # plain HTTP is not served
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_tokenizer_revision_without_tokenizer_applies_to_the_models_tokenizer(launch_dir):
    """vLLM: --tokenizer defaults to MODEL, and --tokenizer-revision applies to it."""
    _, model_path, tokenizer_path, _ = launch(
        "HuggingFaceTB/SmolLM2-135M-Instruct --tokenizer-revision main")
    assert tokenizer_path is not None and tokenizer_path.name == "c" * 40
    assert launch("HuggingFaceTB/SmolLM2-135M-Instruct")[2] is None      # no flag: the model's


def test_chat_template_file_inline_or_refused(launch_dir):
    from specserve.server.cli import ChatTemplateError, read_chat_template

    assert read_chat_template("gen/template.jinja") == "{{ messages }}"
    assert read_chat_template("{{ m }}\\n{{ n }}") == "{{ m }}\n{{ n }}"   # escapes decoded
    with pytest.raises(ChatTemplateError, match="looks like a file path"):
        read_chat_template("templates/nothing.jinja")


@pytest.mark.parametrize("fragment, parser, auto, reasoning", [
    ("", None, True, None),                               # specserve's default: auto works
    ("--enable-auto-tool-choice --tool-call-parser hermes", "hermes", True, None),
    ("--tool-call-parser qwen3_coder", "qwen3_coder", False, None),   # vLLM: no auto then
    ("--reasoning-parser deepseek_r1", None, True, "deepseek_r1"),
])
def test_tool_and_reasoning_flags_reach_the_settings(fragment, parser, auto, reasoning):
    import types

    from specserve.server.cli import server_settings
    args = build_parser().parse_args(["serve", *fragment.split()])
    settings = server_settings(args, types.SimpleNamespace(name="m", path="/m"))
    assert (settings.tool_call_parser, settings.auto_tool_choice,
            settings.reasoning_parser) == (parser, auto, reasoning)


@pytest.mark.parametrize("fragment, unnamed", [
    ("", False), ('--structured-outputs-config {"backend":"xgrammar"}', False),
    ('--structured-outputs-config {"backend":"guidance"}', True),
    ('--structured-outputs-config {"backend":"guidance","disable_additional_properties":true}',
     False),
])
def test_structured_outputs_backend_sets_how_schemas_are_read(fragment, unnamed):
    import types

    from specserve.server.cli import server_settings
    args = build_parser().parse_args(["serve", *fragment.split()])
    settings = server_settings(args, types.SimpleNamespace(name="m", path="/m"))
    assert settings.json_unnamed_properties is unnamed
