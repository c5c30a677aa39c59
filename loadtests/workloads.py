"""Seeded workloads: the same prompts, token counts and arrival times for every peer.

- chat:      short questions, 64 output tokens, closed loop at several concurrencies.
- code-edit: a generated Python function plus "rename this variable and print the whole function";
             the prompt holds most of the answer, which is what n-gram drafting feeds on.
- long:      4-8K-token documents with a question at the end, many requests at once (KV dominates).
- source:    the first N tokens of different source files of this repository at a pinned commit
             (`SOURCE_COMMIT`), as text (compare.py's long-context workloads C and C8K).
- bursty:    chat prompts with open-loop gamma arrivals (shape < 1 is burstier than Poisson).

A cell is one workload at one load level; `cells(size)` lists them in run order.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from loadtests.client import RequestSpec
from loadtests.stats import SLO

TokenCounter = Callable[[str], int]

_TOPICS = ["caches", "rivers", "compilers", "bread", "volcanoes", "chess", "bicycles", "tides",
           "owls", "batteries", "glaciers", "printing presses", "bees", "lighthouses", "vaccines",
           "trains"]
_ASKS = ["Explain how {t} work in simple words.", "Write a short story about {t}.",
         "List three surprising facts about {t}.", "Why do people care about {t}?",
         "Describe the history of {t} in a few sentences.", "What are the main parts of {t}?"]
_WORDS = ("the a of to and in is was for on that with as by at from this it be are which an or "
          "city river market night engine garden winter signal letter window station report number "
          "small large early late quiet bright open old new first last long short simple careful "
          "walked found made kept saw took gave moved built opened wrote read said held "
          "turned").split()
_NAMES = ["total", "count", "items", "value", "result", "index", "buffer", "limit", "offset",
          "score", "weight", "name", "path", "size", "left", "right", "data", "queue", "node",
          "step"]


@dataclass(frozen=True)
class Cell:
    """One workload at one load level: closed loop at `concurrency`, or open loop at `rate`
    req/s."""

    workload: str
    requests: tuple[RequestSpec, ...]
    time_limit_s: float               # no new request after this
    grace_s: float                    # in-flight requests are cancelled this long after the limit
    slo: SLO
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float | None = None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"{self.workload} c={self.concurrency}"
        return f"{self.workload} {self.rate:g} req/s (gamma {self.burstiness:g})"


def chat_prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Question: {rng.choice(_ASKS).format(t=rng.choice(_TOPICS))}\nAnswer:"
            for _ in range(num)]


def _function(rng: random.Random, num_lines: int) -> tuple[str, str]:
    """A plausible Python function and one of its variable names."""
    names = rng.sample(_NAMES, 6)
    lines = [f"def process_{rng.choice(_NAMES)}({names[0]}, {names[1]}):",
             f"    {names[2]} = 0"]
    for i in range(num_lines):
        a, b = rng.sample(names[:4], 2)
        lines.append(rng.choice([
            f"    for {names[4]} in range({a}):",
            f"        {names[2]} += {names[4]} * {rng.randint(2, 9)}",
            f"    if {a} > {rng.randint(1, 99)}:",
            f"        {b} = {a} - {names[2]}",
            f"    {names[3]} = {a} + {b}  # step {i}",
            f"    {names[5]} = [{a}, {b}, {names[2]}]",
        ]))
    lines.append(f"    return {names[2]}")
    return "\n".join(lines), names[2]


def code_edit_prompts(num: int, seed: int, num_lines: int = 24) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        code, old = _function(rng, num_lines)
        new = f"{old}_{rng.choice(['new', 'acc', 'sum', 'out'])}"
        prompts.append(f"Rename the variable `{old}` to `{new}` in the code below and print the "
                       f"whole function.\n\n```python\n{code}\n```\n\nUpdated code:\n```python\n")
    return prompts


def long_prompts(num: int, seed: int, num_tokens: int,
                 count_tokens: TokenCounter | None = None) -> list[str]:
    """Documents of about `num_tokens` tokens (exactly that many when `count_tokens` is given)."""
    rng = random.Random(seed)
    question = "\n\nQuestion: In one sentence, what is this document about?\nAnswer:"
    prompts = []
    for _ in range(num):
        words: list[str] = []
        # Common English words are about 1.1 tokens each; overshoot a little, then trim.
        while len(words) < num_tokens * 1.05:
            sentence = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
            words += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
        if count_tokens is None:
            words = words[: int(num_tokens / 1.1)]
        else:
            lo, hi = 0, len(words)                   # longest prefix that fits, by bisection
            budget = num_tokens - count_tokens(question)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = ((mid, hi) if count_tokens(" ".join(words[:mid])) <= budget
                          else (lo, mid - 1))
            words = words[:lo]
        prompts.append(" ".join(words) + question)
    return prompts


# the long workloads read their prompts from this commit's Python files, not the working tree's:
# their text then stays put while the repository changes, and a cell at two commits drafts on the
# same prompts (the working tree's largest file moved with an edit: in-process, lossy_kv window
# k = 8 at 2.8K took 10.9 ms a token on one file and 24.0 on the next, same code)
SOURCE_COMMIT = "5aee9121ba0f573c5c5b6a084908ad566bd2c9ae"


def pinned_sources(repo: Path, commit: str = SOURCE_COMMIT) -> Path:
    """A folder holding `repo`'s files at `commit` (`git archive`, once, under the specserve
    cache); raises where `repo` is not a git checkout holding that commit."""
    import io
    import subprocess
    import tarfile

    from specserve.spec_phases.paths import cache_dir
    dest = cache_dir() / "workload-sources" / commit
    if not (dest / ".complete").exists():
        try:
            tar = subprocess.run(["git", "-C", str(repo), "archive", commit], check=True,
                                 capture_output=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            raise ValueError(f"the long workloads read their prompts from commit {commit[:12]} "
                             f"of this repository's history, which {repo} lacks ({exc})") from None
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(dest, filter="data")
        (dest / ".complete").touch()
    return dest


def source_files(root: Path) -> list[Path]:
    """The Python files (tests included) under `root` outside virtualenvs and build folders,
    largest first (ties by path): the long workloads' and the long-context benchmarks' prompts
    (`root` = `pinned_sources(...)`)."""
    skip = {".venv", "build", "node_modules", ".git"}
    files = [p for p in root.glob("*/**/*.py") if not skip & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: (-p.stat().st_size, str(p)))


def source_file_prompts(files: Sequence[Path], num: int, num_tokens: int,
                        encode: Callable[[str], list[int]],
                        decode: Callable[[list[int]], str]) -> list[tuple[Path, str]]:
    """The first `num_tokens` tokens of each of the first `num` files holding that many, decoded
    back to text: [(file, prompt)]. Raises when fewer than `num` files are long enough."""
    out = []
    for path in files:
        ids = encode(path.read_text(errors="replace"))
        if len(ids) >= num_tokens:
            out.append((path, decode(ids[:num_tokens])))
        if len(out) == num:
            return out
    raise ValueError(f"only {len(out)} of {len(files)} files hold {num_tokens} tokens; "
                     f"{num} wanted")


def gamma_arrivals(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Arrival offsets with gamma gaps: mean gap 1/rate; burstiness 1 is Poisson, < 1 burstier."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


SIZES = {
    # chat/code-edit: concurrency levels and requests per level; long: (prompt tokens, requests,
    # concurrency); bursty: (req/s, requests); limit_s/grace_s per cell (long gets twice both).
    # "modest" is sized for about 5 minutes per peer on 2 cores, so five peers fit in ~30 minutes.
    "smoke": dict(chat_levels=(1, 4), chat_n=4, code_levels=(1,), code_n=2, long=(1024, 2, 2),
                  bursty=(1.0, 4), limit_s=8.0, grace_s=10.0),
    "modest": dict(chat_levels=(1, 8, 16), chat_n=64, code_levels=(1, 8), code_n=32,
                   long=(4096, 4, 4), bursty=(2.0, 50), limit_s=20.0, grace_s=15.0),
}


def cells(size: str = "modest", seed: int = 0,
          count_tokens: TokenCounter | None = None) -> list[Cell]:
    cfg = SIZES[size]
    limit, grace = cfg["limit_s"], cfg["grace_s"]
    chat_slo, long_slo = SLO(ttft_s=2.0, tpot_s=0.2), SLO(ttft_s=30.0, tpot_s=0.5)
    out = []
    for c in cfg["chat_levels"]:
        prompts = chat_prompts(max(cfg["chat_n"], 2 * c), seed)
        out.append(Cell("chat", tuple(RequestSpec(p, 64) for p in prompts), limit, grace, chat_slo,
                        concurrency=c))
    for c in cfg["code_levels"]:
        prompts = code_edit_prompts(max(cfg["code_n"], 2 * c), seed + 1)
        out.append(Cell("code-edit", tuple(RequestSpec(p, 128) for p in prompts), limit, grace,
                        chat_slo, concurrency=c))
    num_tokens, num, conc = cfg["long"]
    prompts = long_prompts(num, seed + 2, num_tokens, count_tokens)
    out.append(Cell("long", tuple(RequestSpec(p, 32) for p in prompts), 2 * limit, 2 * grace,
                    long_slo, concurrency=conc))
    rate, num = cfg["bursty"]
    arrivals = gamma_arrivals(num, rate, 0.25, seed + 3)
    prompts = chat_prompts(num, seed + 4)
    out.append(Cell("bursty", tuple(RequestSpec(p, 64, a) for p, a in zip(prompts, arrivals)),
                    limit, grace, chat_slo, rate=rate, burstiness=0.25))
    return out
