"""The torch-free compressor table the CLI validates with agrees with the real constructors."""
import inspect
from dataclasses import fields

import pytest
from specserve.kv_cache.compress.base import CompressorConfig
from specserve.kv_cache.compress.mustafar import MustafarCompressor
from specserve.kv_cache.compress.quant import QuantCompressor
from specserve.kv_cache.compress.registry import COMPRESSORS, LAYOUT_KEYS, SETTINGS, check_settings
from specserve.kv_cache.compress.spherical import SphericalCompressor
from specserve.kv_cache.compress.window import WindowCompressor

CLASSES = {"window": WindowCompressor, "quant": QuantCompressor, "spherical": SphericalCompressor,
           "mustafar": MustafarCompressor}
# expanded by build_compressor
SHORTHANDS = {"mustafar": {"sparsity"}, "spherical": {"calib_tokens"}}


def test_layout_keys_are_the_compressor_config_fields():
    sized = {"num_layers", "num_kv_heads", "head_dim"}
    assert set(LAYOUT_KEYS) == {f.name for f in fields(CompressorConfig)} - sized


@pytest.mark.parametrize("name", COMPRESSORS)
def test_settings_are_the_constructor_keywords(name):
    params = (set(inspect.signature(CLASSES[name].__init__).parameters)
              - {"self", "config", "codebooks"})
    assert set(SETTINGS[name]) == params | SHORTHANDS.get(name, set())


def test_check_settings_names_what_is_wrong():
    check_settings("quant", {"key_bits": 8, "window": 16})
    with pytest.raises(ValueError, match="'zip'"):
        check_settings("zip", {})
    with pytest.raises(ValueError, match=r"\['bogus'\]"):
        check_settings("window", {"window": 8, "bogus": 1})
    with pytest.raises(ValueError, match="JSON object"):
        check_settings("quant", [1, 2])
