"""`--kv-draft-compressor` / `--kv-draft-compressor-config` on `specserve serve`: mapped onto
SpeculativeConfig's kv_compressor / kv_compressor_config, refused with a message naming the flag."""
import json

import pytest
from specserve.server.cli import build_parser, engine_config

LOSSY = '{"method": "lossy_kv", "num_speculative_tokens": 16}'


def config_of(*flags):
    return engine_config(build_parser().parse_args(["serve", "tiny-random", *flags]))


def refused(*flags) -> str:
    with pytest.raises(SystemExit) as info:
        config_of(*flags)
    assert isinstance(info.value.code, str), "expected a message, not a bare exit status"
    return info.value.code


def test_flags_map_onto_the_speculative_config():
    spec = config_of("--speculative-config", LOSSY, "--kv-draft-compressor", "quant",
                     "--kv-draft-compressor-config",
                     '{"key_bits": 8, "value_bits": 4, "window": 32}').speculative
    assert (spec.method, spec.num_speculative_tokens) == ("lossy_kv", 16)
    assert spec.kv_compressor == "quant"
    assert spec.kv_compressor_config == {"key_bits": 8, "value_bits": 4, "window": 32}


def test_the_issue_example():
    spec = config_of("--speculative-config", LOSSY, "--kv-draft-compressor", "mustafar",
                     "--kv-draft-compressor-config", '{"sparsity": 0.7}').speculative
    assert (spec.kv_compressor, spec.kv_compressor_config) == ("mustafar", {"sparsity": 0.7})


def test_one_flag_alone_keeps_the_other_from_the_json():
    spec = config_of("--speculative-config",
                     '{"method": "lossy_kv", "kv_compressor_config": {"window": 8}}',
                     "--kv-draft-compressor", "window").speculative
    assert (spec.kv_compressor, spec.kv_compressor_config) == ("window", {"window": 8})
    spec = config_of("--speculative-config", '{"method": "lossy_kv", "kv_compressor": "spherical"}',
                     "--kv-draft-compressor-config", '{"tier": 2}').speculative
    assert (spec.kv_compressor, spec.kv_compressor_config) == ("spherical", {"tier": 2})


def test_values_inside_the_speculative_config_keep_working():
    inner = {"method": "lossy_kv", "kv_compressor": "quant",
             "kv_compressor_config": {"key_bits": 2}}
    spec = config_of("--speculative-config", json.dumps(inner)).speculative
    assert (spec.kv_compressor, spec.kv_compressor_config) == ("quant", {"key_bits": 2})
    # the default
    assert config_of("--speculative-config", LOSSY).speculative.kv_compressor == "mustafar"


def test_equal_values_in_both_places_are_fine_conflicting_ones_are_refused():
    both = (
        '{"method": "lossy_kv", "kv_compressor": "quant", "kv_compressor_config": {"key_bits": 8}}')
    spec = config_of("--speculative-config", both, "--kv-draft-compressor", "quant",
                     "--kv-draft-compressor-config", '{"key_bits": 8}').speculative
    assert (spec.kv_compressor, spec.kv_compressor_config) == ("quant", {"key_bits": 8})
    msg = refused("--speculative-config", both, "--kv-draft-compressor", "window")
    assert "--kv-draft-compressor" in msg and "conflicts" in msg and '"quant"' in msg
    msg = refused("--speculative-config", both, "--kv-draft-compressor-config", '{"key_bits": 4}')
    assert "--kv-draft-compressor-config" in msg and "conflicts" in msg
    # the JSON naming the default explicitly still counts as given
    msg = refused("--speculative-config", '{"method": "lossy_kv", "kv_compressor": "mustafar"}',
                  "--kv-draft-compressor", "quant")
    assert "conflicts" in msg and '"mustafar"' in msg


def test_unknown_compressor_name_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--speculative-config", LOSSY, "--kv-draft-compressor",
                                   "zip"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-draft-compressor" in err and "'zip'" in err


def test_unknown_compressor_inside_the_json_names_it():
    msg = refused("--speculative-config", '{"method": "lossy_kv", "kv_compressor": "zip"}')
    assert '"kv_compressor"' in msg and "'zip'" in msg


@pytest.mark.parametrize("text, words",
                         [("{sparsity: 0.7}", "not valid JSON"), ("[0.7]", "JSON object"),
                                         ('"mustafar"', "JSON object"), ("", "not valid JSON")])
def test_bad_json_is_refused(text, words):
    msg = refused("--speculative-config", LOSSY, "--kv-draft-compressor-config", text)
    assert msg.startswith("specserve: --kv-draft-compressor-config") and words in msg


def test_unknown_config_keys_are_refused_for_the_chosen_compressor():
    msg = refused("--speculative-config", LOSSY, "--kv-draft-compressor", "quant",
                  "--kv-draft-compressor-config", '{"sparsity": 0.7}')
    assert "--kv-draft-compressor-config" in msg and "['sparsity']" in msg and "key_bits" in msg
    # keys from the JSON are checked against the compressor the flag picked
    msg = refused("--speculative-config",
                  '{"method": "lossy_kv", "kv_compressor_config": {"sparsity": 0.5}}',
                  "--kv-draft-compressor", "window")
    assert '--speculative-config "kv_compressor_config"' in msg and "['sparsity']" in msg
    msg = refused("--speculative-config",
                  '{"method": "lossy_kv", "kv_compressor_config": {"bogus": 1}}')
    assert "['bogus']" in msg


@pytest.mark.parametrize("spec", [None, '{"method": "ngram"}'])
@pytest.mark.parametrize("flags",
                         [["--kv-draft-compressor", "quant"],
                          ["--kv-draft-compressor-config", "{}"]])
def test_flags_need_the_lossy_kv_method(spec, flags):
    msg = refused(*(["--speculative-config", spec] if spec else []), *flags)
    assert msg.startswith(f"specserve: {flags[0]} requires") and "lossy_kv" in msg
    assert ("'ngram'" if spec else "no --speculative-config") in msg


def test_other_methods_are_untouched():
    spec = config_of("--speculative-config",
                     '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, '
                     '"num_speculative_tokens": 3}').speculative
    assert spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert config_of().speculative is None


def test_the_engine_builds_the_flagged_compressor(make_engine):
    """The mapped config reaches the drafter: the worker's proposer uses the flagged compressor."""
    spec = config_of("--speculative-config", '{"method": "lossy_kv", "num_speculative_tokens": 2}',
                     "--kv-draft-compressor", "quant",
                     "--kv-draft-compressor-config",
                     '{"key_bits": 8, "value_bits": 2, "page_size": 8}').speculative
    core = make_engine(speculative=spec, num_threads=1)
    comp = core.worker.draft_pool.comp
    assert (comp.name, comp.config.page_size) == ("int8k-int2v", 8)
