"""Chat templates sent in a request, rendered under a budget (`--trust-request-chat-template`).

A request's template is code: its Jinja loops run wherever it is rendered, and a thread cannot
be stopped. So it is rendered in a child process that holds a copy of the tokenizer, one render
at a time, at the lowest CPU priority, within a wall-clock budget and an address-space cap; past
either, the child is killed (a fresh one starts with the next render) and the request gets a 400
naming `chat_template`.
The server's own template (the model's, or `--chat-template`) never comes here.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import threading
from typing import Any

RENDER_BUDGET_S = 2.0
MEMORY_CAP_BYTES = 1 << 30          # address space the child may add while rendering
START_TIMEOUT_S = 120.0             # the child imports transformers once; not part of the budget


class TemplateBudgetError(ValueError):
    """The template ran past its budget (time, memory or output size)."""


class TemplateRenderError(ValueError):
    """The template failed on these messages (its own error, as the tokenizer reported it)."""


class TemplateSandbox:
    """Renders request templates in a child process; safe to call from several threads."""

    def __init__(self, tokenizer: Any, budget_s: float = RENDER_BUDGET_S,
                 max_chars: int | None = None, memory_cap: int = MEMORY_CAP_BYTES):
        self.tokenizer = tokenizer
        self.budget_s = budget_s
        self.max_chars = max_chars
        self.memory_cap = memory_cap
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Any = None

    def start(self) -> None:
        """Start the child now (the server does at start-up when request templates are trusted),
        so its start is not paid while serving."""
        with self._lock:
            self._start()

    def render(self, conversation: list[dict], template: str, **kwargs: Any) -> str:
        """`tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
        **kwargs)` in the child, within the budget."""
        with self._lock:
            self._start()
            self._conn.send((conversation, template, kwargs))
            if not self._conn.poll(self.budget_s):
                self._kill()
                raise TemplateBudgetError(f"the request's chat template ran longer than its "
                                          f"budget of {self.budget_s:g} s")
            try:
                outcome, value = self._conn.recv()
            except (EOFError, OSError):
                outcome, value = "memory", None
            if outcome == "memory":
                self._kill()
                raise TemplateBudgetError("the request's chat template exceeded its memory "
                                          "budget")
        if outcome == "error":
            raise TemplateRenderError(value)
        if self.max_chars is not None and len(value) > self.max_chars:
            raise TemplateBudgetError(f"the request's chat template rendered {len(value)} "
                                      f"characters, more than the context could hold")
        return value

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self._kill()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_child_main,
                                    args=(pickle.dumps(self.tokenizer), child, self.memory_cap),
                                    name="specserve-template", daemon=True)
        # started from a thread at the lowest priority, which the child inherits from its first
        # instruction on (Linux priorities are per thread): its imports and renders yield the CPU
        # to the engine's steps
        launcher = threading.Thread(target=_start_niced, args=(self._process,))
        launcher.start()
        launcher.join()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S) or self._conn.recv() != "ready":
            self._kill()
            raise RuntimeError("the chat-template process did not start")

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._conn.close()
        self._process = self._conn = None


def _start_niced(process: Any) -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    process.start()


def _child_main(tokenizer_bytes: bytes, conn: Any, memory_cap: int) -> None:
    import jinja2  # noqa: F401  (imported before the cap: the render itself must fit under it)

    tokenizer = pickle.loads(tokenizer_bytes)

    with open("/proc/self/statm") as statm:              # Linux: pages mapped now
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + memory_cap
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY
                                            else min(cap, hard), hard))
    conn.send("ready")
    while True:
        try:
            conversation, template, kwargs = conn.recv()
        except EOFError:
            return
        try:
            text = tokenizer.apply_chat_template(conversation, chat_template=template,
                                                 tokenize=False, **kwargs)
            conn.send(("ok", text))
        except MemoryError:
            conn.send(("memory", None))
        except Exception as exc:                  # noqa: BLE001 — the template's own error
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
