"""The Prometheus text parser and the spec-decode counter deltas."""
import math

import pytest

from loadtests.metrics import (counter_totals, parse_labels, parse_prometheus,
                                         spec_decode_delta)

BEFORE = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 1.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 2.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 0.0
vllm:generation_tokens_total{engine="0",model_name="tiny"} 4.0
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
"""

AFTER = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 11.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 62.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 5.0
vllm:generation_tokens_total{engine="0",model_name="tiny"} 84.0
"""


def test_parse_samples_labels_and_values():
    samples = parse_prometheus(BEFORE)
    assert len(samples) == 7                                       # HELP/TYPE skipped
    first = samples[0]
    assert first.name == "vllm:spec_decode_num_drafts_total"
    assert first.labels == {"engine": "0", "model_name": "tiny"}
    assert first.value == 1.0
    assert samples[1].value == pytest.approx(1.7e9)


def test_parse_escapes_timestamps_and_special_values():
    text = ('m{a="x\\"y",b="1,2}"} +Inf 1700000000\n'
            "plain 3\n"
            'n{} NaN\n')
    a, b, c = parse_prometheus(text)
    assert a.labels == {"a": 'x"y', "b": "1,2}"} and math.isinf(a.value)
    assert (b.name, b.labels, b.value) == ("plain", {}, 3.0)
    assert math.isnan(c.value)
    assert parse_labels('le="0.5" , x="\\n"') == {"le": "0.5", "x": "\n"}


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_prometheus("this is not a sample\n")


def test_counter_totals_sum_over_labels_and_key_positions():
    totals = counter_totals(parse_prometheus(AFTER))
    assert totals["vllm:spec_decode_num_drafts_total"] == 21.0   # two engines add up
    assert totals["vllm:spec_decode_num_accepted_tokens_per_pos_total[2]"] == 5.0
    assert "vllm:spec_decode_num_drafts_created" not in totals


def test_spec_decode_delta_derives_vllm_quantities():
    before = counter_totals(parse_prometheus(BEFORE))
    after = counter_totals(parse_prometheus(AFTER))
    stats = spec_decode_delta(before, after)
    assert stats.num_drafts == 20.0
    assert stats.num_draft_tokens == 60.0
    assert stats.num_accepted_tokens == 30.0
    assert stats.num_generation_tokens == 80.0
    assert stats.acceptance_rate == pytest.approx(0.5)
    assert stats.mean_acceptance_length == pytest.approx(2.5)       # 1 + 30 / 20
    assert stats.acceptance_per_pos == pytest.approx([0.75, 0.5, 0.25])
    assert stats.to_dict()["mean_acceptance_length"] == pytest.approx(2.5)


def test_spec_decode_delta_without_speculation_is_nan():
    stats = spec_decode_delta({},
                              counter_totals(parse_prometheus("vllm:generation_tokens_total 5\n")))
    assert stats.num_generation_tokens == 5.0
    assert math.isnan(stats.acceptance_rate) and math.isnan(stats.mean_acceptance_length)
    assert stats.acceptance_per_pos == []
