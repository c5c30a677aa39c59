"""Probe: FASER's margin in-process, the compare harness' closed loop (c = 8, its 32 requests of
workload A or B), against spec off, alternated: `benchmarks/chat_speculation.py`'s loop, the
controller's margin set on each engine it builds.

    python benchmarks/results/cpu/faser-host-probe/margin.py B,A 2 0.03,0.1,0.2
"""
import sys
from pathlib import Path

from specserve.loadtests import compare
from specserve.scheduler.engine import EngineCore
from specserve.server.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))           # benchmarks/
import chat_speculation  # noqa: E402


def with_margin(margin: float):
    """An EngineCore factory whose FASER controller uses `margin`."""
    def build(config):
        core = EngineCore(config)
        core.scheduler.controller.margin = margin
        return core
    return build


def main() -> None:
    tokenizer = load_tokenizer(None)
    loads = compare.workloads(0, 32)
    margins = [None] + [float(m) for m in sys.argv[3].split(",")]
    for wl in sys.argv[1].split(","):
        prompts = [tokenizer.encode(s.prompt) for s in loads[wl]]
        max_tokens = loads[wl][0].max_tokens                     # every request of a workload
        for rep in range(int(sys.argv[2])):
            for margin in margins:
                chat_speculation.EngineCore = EngineCore if margin is None else with_margin(margin)
                method = "off" if margin is None else "adaptive"
                result = chat_speculation.run(prompts, chat_speculation.METHODS[method],
                                              max_tokens, 8)
                print(f"{wl} rep{rep} margin {margin}: {result}", flush=True)


if __name__ == "__main__":
    main()
