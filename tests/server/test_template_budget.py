"""Request chat templates render in a child process under a time, memory and size budget."""
import os

import pytest

from specserve.server.template_budget import (TemplateBudgetError, TemplateRenderError,
                                              TemplateSandbox)

MESSAGES = [{"role": "user", "content": "Hello there"}]
SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
LOOPING = "{% for i in range(1000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
HUGE = "{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}"


@pytest.fixture(scope="module")
def sandbox(tokenizer):
    box = TemplateSandbox(tokenizer, budget_s=2.0, max_chars=50_000, memory_cap=256 << 20)
    yield box
    box.close()


def test_a_request_template_renders_as_the_tokenizer_would(sandbox, tokenizer):
    got = sandbox.render(MESSAGES, SIMPLE, add_generation_prompt=True)
    assert got == tokenizer.apply_chat_template(MESSAGES, chat_template=SIMPLE, tokenize=False,
                                                add_generation_prompt=True)
    assert got == "<user>Hello there"
    # the child yields the CPU to the engine: lowest priority, inherited from its start
    assert os.getpriority(os.PRIO_PROCESS, sandbox._process.pid) == 19


def test_a_looping_template_is_stopped_and_the_next_render_works(sandbox):
    with pytest.raises(TemplateBudgetError, match="budget of 2 s"):
        sandbox.render(MESSAGES, LOOPING)
    assert sandbox.render(MESSAGES, SIMPLE) == "<user>Hello there"     # a fresh child


def test_templates_past_memory_or_size_and_broken_ones_are_refused(sandbox):
    with pytest.raises(TemplateBudgetError):
        sandbox.render(MESSAGES, HUGE)                        # ~10 GB of output: memory cap
    with pytest.raises(TemplateBudgetError, match="more than the context"):
        sandbox.render(MESSAGES, "{{ 'z' * 60000 }}")
    with pytest.raises(TemplateRenderError, match="boom"):
        sandbox.render(MESSAGES, "{{ raise_exception('boom') }}")
    assert sandbox.render(MESSAGES, SIMPLE) == "<user>Hello there"
