"""Incremental detokenization (whole characters only) and stop strings across token boundaries."""
from __future__ import annotations

from conftest import SCRIPT

from specserve.server.cli import build_parser, engine_config
from specserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher


def test_detokenizer_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.step([t]) for t in ids]
    assert "".join(pieces) == SCRIPT
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces and any("世" in p for p in pieces)   # partial bytes wait, then whole chars


def test_slow_path_fallback_matches(tokenizer):
    class Slow:                                    # no backend tokenizer: diff of full decodes
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    detok = IncrementalDetokenizer(Slow())
    pieces = [detok.step([t]) for t in ids]
    assert "".join(pieces) == SCRIPT and not any("\ufffd" in p for p in pieces)


def test_stop_matcher_holds_back_and_trims():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abcST").text == "ab"            # "ST" may be the start of STOP: held back
    out = m.feed("OPxyz")
    assert (out.text, out.stop) == ("c", "STOP")
    assert m.feed("more").text == "" and m.flush() == ""


def test_stop_matcher_release_on_flush_and_include():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abST").text == "a" and m.flush() == "bST"
    inc = StopStringMatcher(["b c", "c"], include_in_output=True)
    out = inc.feed("a b c d")
    assert (out.text, out.stop) == ("a b c", "b c")   # earliest match wins


def test_cli_maps_flags_onto_engine_config():
    args = build_parser().parse_args(["serve", "tiny-random", "--max-model-len", "128",
                                      "--block-size", "32",
                                      "--no-enable-prefix-caching", "--kv-cache-memory-gb", "0.5",
                                      "--speculative-config",
                                      '{"method": "ngram", "prompt_lookup_min": 1, '
                                      '"prompt_lookup_max": 4, "num_speculative_tokens": 3}',
                                      "--served-model-name", "a", "b", "--api-key", "k"])
    config = engine_config(args)
    assert (config.model, config.max_model_len, config.block_size) == ("tiny-random", 128, 32)
    assert config.enable_prefix_caching is False and config.kv_cache_memory_gb == 0.5
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 3
    assert args.served_model_name == ["a", "b"] and args.api_key == "k"
