"""Read Prometheus text exposition and turn `vllm:spec_decode_*` counter deltas into acceptance
numbers.

Definitions (metrics-and-deploy.md §3):
    acceptance rate             = accepted tokens / draft tokens
    mean acceptance length      = 1 + accepted tokens / drafts  (bonus token included, at most k+1)
    acceptance at position i    = accepted_per_pos{position=i} / drafts
Counters are summed over every label set except `position` (several engines or model names add up).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import httpx

PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?"
                     r"\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            if text[pos:].strip():
                raise ValueError(f"bad label set: {text!r}")
            break
        labels[match.group(1)] = _unescape(match.group(2))
        pos = match.end()
    return labels


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample in a text exposition; `# HELP`/`# TYPE` and blank lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        samples.append(Sample(match["name"], parse_labels(match["labels"] or ""),
                              float(match["value"])))
    return samples


def counter_totals(samples: list[Sample]) -> dict[str, float]:
    """The spec-decode and generation counters, summed over labels; per-position ones
    keyed `name[i]`."""
    totals: dict[str, float] = {}
    for s in samples:
        if not (s.name.startswith(PREFIX) or s.name == "vllm:generation_tokens_total") \
                or not s.name.endswith("_total"):
            continue
        key = f"{s.name}[{s.labels['position']}]" if "position" in s.labels else s.name
        totals[key] = totals.get(key, 0.0) + s.value
    return totals


@dataclass
class SpecDecodeStats:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    num_generation_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return (self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens
                else math.nan)

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else math.nan for n in self.accepted_per_pos]

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_generation_tokens": self.num_generation_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_per_pos": self.acceptance_per_pos}


def spec_decode_delta(before: dict[str, float], after: dict[str, float]) -> SpecDecodeStats:
    """Counter deltas between two `counter_totals` snapshots (a counter missing before counts
    as 0)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    per_pos_name = PREFIX + "num_accepted_tokens_per_pos_total"
    positions = sorted(int(k[len(per_pos_name) + 1:-1]) for k in after
                       if k.startswith(per_pos_name + "["))
    return SpecDecodeStats(
        num_drafts=delta(PREFIX + "num_drafts_total"),
        num_draft_tokens=delta(PREFIX + "num_draft_tokens_total"),
        num_accepted_tokens=delta(PREFIX + "num_accepted_tokens_total"),
        num_generation_tokens=delta("vllm:generation_tokens_total"),
        accepted_per_pos=[delta(f"{per_pos_name}[{i}]") for i in positions],
    )


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """`counter_totals` of GET /metrics, or None when the server has no (parsable) metrics
    endpoint."""
    try:
        response = await client.get(f"{base_url}/metrics", timeout=10.0)
        if response.status_code != 200:
            return None
        return counter_totals(parse_prometheus(response.text))
    except (httpx.HTTPError, ValueError):
        return None
