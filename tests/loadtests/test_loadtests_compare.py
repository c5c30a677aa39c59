"""The quick side-by-side (loadtests/compare.py): workloads, server commands, the ratio table."""
from loadtests import compare


def test_workloads_a_and_b_have_the_issue_shapes():
    loads = compare.workloads(seed=0, num_requests=32)
    assert [len(loads["A"]), len(loads["B"])] == [32, 32]
    assert ({r.max_tokens for r in loads["A"]} == {64}
            and {r.max_tokens for r in loads["B"]} == {128})
    assert len({r.prompt for r in loads["B"]}) > 16                  # distinct questions


def test_server_commands_differ_only_where_they_should():
    plain = compare.SERVERS["specserve-plain"](9000, 16).cmd
    assert "--speculative-config" not in plain and "--engine-in-thread" not in plain
    assert "--engine-in-thread" in compare.SERVERS["specserve-thread"](9000, 16).cmd
    assert '"adaptive": true' in " ".join(
        compare.SERVERS["specserve-ngram-adaptive"](9000, 16).cmd)


def test_llama_server_gets_a_slot_per_concurrent_request():
    cmd = compare.SERVERS["llama-server"](9000, 16).cmd
    assert cmd[cmd.index("--parallel") + 1] == "16"
    assert cmd[cmd.index("--ctx-size") + 1] == str(16 * compare.MAX_MODEL_LEN)
    assert "8-bit activations" in compare.weights("llama-server")


def test_ratios_are_made_against_vllm_then_every_other_peer():
    assert compare.peers_of(["specserve-plain", "llama-server", "vllm-cpu-fp32",
                             "vllm-cpu-ngram"]) == ["vllm-cpu-fp32", "llama-server",
                                                    "vllm-cpu-ngram"]
    assert compare.peers_of(["specserve-plain", "specserve-fp32"]) == ["specserve-fp32"]


def test_table_takes_medians_and_ratios_to_the_vllm_server():
    def run(a1, b1):
        cells = {f"{w} c={c}": {"tok_s": v, "ttft_p50_ms": 100.0}
                 for w, v in (("A", a1), ("B", b1)) for c in (1,)}
        return {"cells": cells, "startup_s": 5.0, "peak_rss_gib": 1.5}
    runs = {"ours": [run(30, 10), run(50, 30)], "vllm-cpu": [run(20, 20), run(20, 20)]}
    host = {"model": "Xeon", "cpus": "2", "flags": ["avx512f", "avx512_vnni"]}
    text = compare.table(["ours", "vllm-cpu"], runs, [1], "vllm-cpu", host)
    row = next(line for line in text.splitlines() if line.startswith("| ours"))
    assert "40.0 (2.00×)" in row and "20.0 (1.00×)" in row
    assert "ratio to vllm-cpu" in text and "lscpu flags: avx512f avx512_vnni" in text
    header, rule = text.splitlines()[:2]
    assert header.count("|") == rule.count("|") == row.count("|")       # a markdown table


def test_a_cell_a_server_failed_is_an_error_not_a_ratio():
    """A round in which a server completed nothing in a cell (the cell missing from its run)
    shows "error" there, and the other servers' cells get no ratio against it."""
    def run(cells):
        return {"cells": {c: {"tok_s": 10.0, "ttft_p50_ms": 50.0} for c in cells},
                "startup_s": 5.0, "peak_rss_gib": 1.5}
    both = ["A c=1", "B c=1"]
    runs = {"ours": [run(both), run(both)], "vllm-cpu": [run(both), run(["B c=1"])]}
    text = compare.table(["ours", "vllm-cpu"], runs, [1], "vllm-cpu")
    ours = next(line for line in text.splitlines() if line.startswith("| ours"))
    theirs = next(line for line in text.splitlines() if line.startswith("| vllm-cpu"))
    assert theirs.split(" | ")[2] == "error" and ours.split(" | ")[2] == "10.0"
    assert ours.split(" | ")[3] == "10.0 (1.00×)"
    assert "int8 activations" in ours and "bf16" in theirs              # weight formats named
