"""The official `openai` client (sync, async, streaming) against a real uvicorn around the fake
engine."""
from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import MODEL, SCRIPT


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"),
                         max_retries=0, **kw)


def test_completion_sync_greedy_text_and_usage(server):
    out = client(server).completions.create(model=MODEL, prompt="Say", max_tokens=4, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    assert out.choices[0].text == " The quick brown fox"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens == 1 and out.usage.completion_tokens == 4
            and out.usage.total_tokens == 5)
    assert out.system_fingerprint == "specserve-0.1.0"


def test_completion_runs_to_eos_with_stop_finish_and_whole_utf8(server):
    out = client(server).completions.create(model=MODEL, prompt="Say", max_tokens=100,
                                            temperature=0)
    assert out.choices[0].text == SCRIPT                     # EOS text is not shown
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] is None                  # EOS: no stop_reason
    assert out.usage.completion_tokens == len(server.engine.script_ids) + 1   # EOS counted


def test_alias_is_echoed_and_default_model_works(server):
    c = client(server)
    assert c.completions.create(model="fake-alias", prompt="x", max_tokens=1).model == "fake-alias"
    assert c.models.list().data[0].id == MODEL


def test_n_times_several_prompts_indexing(server):
    out = client(server).completions.create(model=MODEL, prompt=["a", "b b", "c c c"], n=2,
                                            max_tokens=3,
                                            temperature=0)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert all(c.text == " The quick brown" for c in out.choices)
    assert out.usage.prompt_tokens == 1 + 2 + 3 and out.usage.completion_tokens == 18
    prompts_seen = [r.prompt_token_ids for r in server.engine.submitted]
    assert (prompts_seen[0] == prompts_seen[1]
            and prompts_seen[2] == prompts_seen[3] != prompts_seen[0])


def test_token_id_prompts_and_return_token_ids(server):
    out = client(server).completions.create(model=MODEL, prompt=[[504, 3575], [282]], max_tokens=2,
                                            temperature=0, extra_body={"return_token_ids": True})
    extra = [c.model_extra for c in out.choices]
    assert [e["prompt_token_ids"] for e in extra] == [[504, 3575], [282]]
    assert extra[0]["token_ids"] == server.engine.script_ids[:2]


def test_logprobs_with_echo(server, tokenizer):
    out = client(server).completions.create(model=MODEL, prompt="The capital", max_tokens=3,
                                            temperature=0,
                                            logprobs=2, echo=True)
    choice = out.choices[0]
    prompt_ids = tokenizer.encode("The capital")
    lp = choice.logprobs
    assert choice.text == "The capital The quick brown"
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None     # first prompt token
    assert all(v == -0.25 for v in lp.token_logprobs[1:])
    # sampled already in top-2
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0
    assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))


def test_logprobs_zero_gives_only_the_sampled_token(server):
    out = client(server).completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0,
                                            logprobs=0)
    assert [list(t) for t in out.choices[0].logprobs.top_logprobs] == [[" The"], [" quick"]]


def test_stop_string_split_across_tokens_is_trimmed(server):
    c = client(server)
    out = c.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0,
                               stop=["ick bro"])
    assert out.choices[0].text == " The qu"
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == "ick bro"
    assert out.usage.completion_tokens == 3
    kept = c.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0,
                                stop="ick bro",
                                extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " The quick bro"
    assert server.engine.aborted                      # the engine request was stopped early


def test_stop_string_streaming_never_leaks_a_partial_stop(server):
    stream = client(server).completions.create(model=MODEL, prompt="x", max_tokens=20,
                                               temperature=0,
                                               stop=["fox jumps"], stream=True)
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(texts) == " The quick brown "
    assert not any("fox" in t for t in texts)


def test_stop_token_ids(server):
    fox = server.engine.script_ids[3]
    out = client(server).completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0,
                                            extra_body={"stop_token_ids": [fox]})
    assert out.choices[0].text == " The quick brown"
    assert (out.choices[0].finish_reason == "stop"
            and out.choices[0].model_extra["stop_reason"] == fox)


def test_seed_reproducible_and_n_children_differ(server):
    c = client(server)
    a = c.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=1.0, seed=1234, n=3)
    b = c.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=1.0, seed=1234, n=3)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    seeds = [r.sampling_params.seed for r in server.engine.submitted[:3]]
    assert seeds == [1234, 1235, 1236]


def test_sampling_fields_reach_the_engine(server):
    client(server).completions.create(
        model=MODEL, prompt="x", max_tokens=5, temperature=0.5, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"42": 200}, user="alice", best_of=1,
        extra_body={"top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
                    "min_tokens": 2, "num_speculative_tokens": 0})
    p = server.engine.submitted[-1].sampling_params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 7, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {42: 100.0} and p.ignore_eos and p.min_tokens == 2
    assert p.num_speculative_tokens == 0 and p.max_tokens == 5


def test_completion_streaming_sync_with_usage(server):
    stream = client(server).completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        text[chunk.choices[0].index] = text.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert text == {i: " The quick brown" for i in range(4)}
    assert len({c.id for c in chunks}) == 1


def test_completion_async_and_async_stream(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        plain, stream = await asyncio.gather(
            c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0),
            c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0, stream=True))
        pieces = [chunk.choices[0].text async for chunk in stream]
        await c.close()
        return plain.choices[0].text, "".join(pieces)

    assert asyncio.run(run()) == (" The quick", " The quick")


def test_chat_sync_async_stream(server):
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == " The quick brown"
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                       n=2,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    firsts = {}
    for chunk in chunks[:-1]:
        firsts.setdefault(chunk.choices[0].index, chunk.choices[0].delta)
    assert (all(d.role == "assistant" and d.content == "" for d in firsts.values())
            and len(firsts) == 2)
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []

    async def run_async():
        a = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = await a.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2,
                                            temperature=0)
        await a.close()
        return r.choices[0].message.content

    assert asyncio.run(run_async()) == " The quick"


def test_chat_template_applied_and_logprobs_shape(server, tokenizer):
    out = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        max_tokens=2, temperature=0, logprobs=True, top_logprobs=3)
    sent = tokenizer.decode(server.engine.submitted[-1].prompt_token_ids)
    assert ("<|im_start|>user\nHi there<|im_end|>" in sent
            and sent.endswith("<|im_start|>assistant\n"))
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == [" The", " quick"]
    assert content[0].bytes == list(b" The") and len(content[0].top_logprobs) == 3


def test_chat_without_limit_uses_rest_of_context(server):
    client(server).chat.completions.create(model=MODEL,
                                           messages=[{"role": "user", "content": "Hi"}])
    request = server.engine.submitted[-1]
    assert request.sampling_params.max_tokens == 512 - len(request.prompt_token_ids)


@pytest.mark.parametrize("kwargs, error, param", [
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"top_p": 0}, openai.BadRequestError, "top_p"),
    ({"n": 0}, openai.BadRequestError, "n"),
    ({"logprobs": 21}, openai.BadRequestError, "logprobs"),
    ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
    ({"max_tokens": 600}, openai.BadRequestError, "max_tokens"),
    ({"suffix": "tail"}, openai.BadRequestError, "suffix"),
    ({"best_of": 3}, openai.BadRequestError, "best_of"),
    ({"prompt": [70000]}, openai.BadRequestError, "prompt"),
    ({"prompt": ""}, openai.BadRequestError, "prompt"),
    ({"model": "nope"}, openai.NotFoundError, "model"),
    ({"logit_bias": {"99999": 1}}, openai.BadRequestError, "logit_bias"),
    ({"extra_body": {"use_beam_search": True}}, openai.BadRequestError, "use_beam_search"),
    ({"stream_options": {"include_usage": True}}, openai.BadRequestError, "stream_options"),
])
def test_completion_errors_map_to_sdk_exceptions(server, kwargs, error, param):
    args = {"model": MODEL, "prompt": "x", "max_tokens": 4, **kwargs}
    with pytest.raises(error) as info:
        client(server).completions.create(**args)
    assert info.value.body["param"] == param
    assert info.value.body["code"] == info.value.status_code


def test_auth_overload_and_engine_errors_map_to_sdk_exceptions(make_server, tokenizer):
    from conftest import FakeEngine
    locked = make_server(api_key="sesame")
    with pytest.raises(openai.AuthenticationError):
        client(locked, api_key="wrong").completions.create(model=MODEL, prompt="x")
    assert client(locked, api_key="sesame").completions.create(model=MODEL, prompt="x",
                                                               max_tokens=1)
    busy = make_server(FakeEngine(tokenizer, max_waiting=0))
    with pytest.raises(openai.APIStatusError) as info:
        client(busy).completions.create(model=MODEL, prompt="x")
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    failing = FakeEngine(tokenizer)
    failing.error_after = 2
    with pytest.raises(openai.InternalServerError):
        client(make_server(failing)).completions.create(model=MODEL, prompt="x", max_tokens=5,
                                                        temperature=0)   # no early EOS
