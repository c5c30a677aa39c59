"""`--generation-config auto|vllm|FOLDER`: the model's generation_config.json gives default
sampling parameters, as vLLM applies them; request fields that are given win."""
import json

import httpx
import pytest
from conftest import FakeEngine

from specserve.server.cli import build_parser, serve_launch
from specserve.server.generation_config import GenerationConfigError, default_sampling

LLAMA3_STYLE = {"bos_token_id": 128000, "eos_token_id": [128001, 128009], "do_sample": True,
                "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                "max_new_tokens": 64}


def model_folder(tmp_path, generation: dict | None = LLAMA3_STYLE, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_auto_reads_the_sampling_keys_and_max_new_tokens_becomes_max_tokens(tmp_path):
    assert default_sampling("auto", model_folder(tmp_path)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
        "max_tokens": 64}


def test_a_file_without_sampling_keys_gives_no_defaults(tmp_path):
    folder = model_folder(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True,
                                     "transformers_version": "4.45.0"})
    assert default_sampling("auto", folder) == {}


def test_vllm_ignores_the_file_and_a_folder_replaces_it(tmp_path):
    model = model_folder(tmp_path)
    assert default_sampling("vllm", model) == {}
    other = model_folder(tmp_path, {"do_sample": True, "temperature": 0.3}, name="other")
    assert default_sampling(str(other), model) == {"temperature": 0.3}
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        default_sampling(str(tmp_path), model)


def test_override_merges_over_the_file(tmp_path):
    defaults = default_sampling("auto", model_folder(tmp_path),
                                {"temperature": 0.2, "max_new_tokens": 8, "min_p": 0.05})
    assert defaults == {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                        "min_p": 0.05, "max_tokens": 8}
    assert default_sampling("vllm", model_folder(tmp_path, None, name="bare"),
                            {"top_k": 5}) == {"top_k": 5}


def test_no_file_and_gguf_models_have_no_defaults(tmp_path):
    assert default_sampling("auto", model_folder(tmp_path, None)) == {}
    assert default_sampling("auto", tmp_path / "model.gguf") == {}


def test_a_value_the_engine_would_refuse_is_refused_at_launch(tmp_path, capsys):
    folder = model_folder(tmp_path, {"do_sample": True, "top_p": 1.5})
    with pytest.raises(GenerationConfigError, match="top_p"):
        default_sampling("auto", folder)
    with pytest.raises(SystemExit) as info:
        serve_launch(build_parser().parse_args(["serve", str(folder)]))
    assert info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_serve_launch_returns_the_defaults(tmp_path):
    folder = model_folder(tmp_path)
    _, _, _, defaults = serve_launch(build_parser().parse_args(["serve", str(folder)]))
    assert defaults["temperature"] == 0.6
    _, _, _, defaults = serve_launch(build_parser().parse_args(
        ["serve", str(folder), "--generation-config", "vllm"]))
    assert defaults == {}


# -- on a running app: what the engine receives ------------------------------------------------
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
            "min_p": 0.05, "max_tokens": 64}


def params_of(srv, path, body):
    r = httpx.post(srv.url + path, json={"model": "fake-model", **body})
    assert r.status_code == 200, r.text
    return srv.engine.submitted[-1].sampling_params


def test_request_fields_left_out_take_the_defaults(make_server):
    srv = make_server(sampling_defaults=DEFAULTS)
    chat = params_of(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert (chat.temperature, chat.top_p, chat.top_k, chat.min_p, chat.repetition_penalty) == \
        (0.6, 0.9, 20, 0.05, 1.1)
    assert chat.max_tokens == 64                    # min(room in the context, max_new_tokens)
    done = params_of(srv, "/v1/completions", {"prompt": "hi", "max_tokens": None})
    assert (done.temperature, done.max_tokens) == (0.6, 64)
    assert params_of(srv, "/v1/completions", {"prompt": "hi"}).max_tokens == 16   # left out: 16


def test_request_fields_given_win(make_server):
    srv = make_server(sampling_defaults=DEFAULTS)
    params = params_of(srv, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_p": 1.0,
        "top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "max_tokens": 100})
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty, params.max_tokens) == (0, 1.0, -1, 0, 1.0, 100)


def test_the_default_max_tokens_is_capped_by_the_room_left(make_server, tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=40)
    srv = make_server(engine, sampling_defaults={"max_tokens": 1000})
    params = params_of(srv, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}]})
    prompt = len(engine.submitted[-1].prompt_token_ids)
    assert params.max_tokens == 40 - prompt


def test_without_defaults_nothing_changes(make_server):
    srv = make_server()
    params = params_of(srv, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}]})
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
