"""Reading vLLM's /metrics (kvtier_tools.server): prometheus_client's parser, labels matched
by value, never by substring."""

from __future__ import annotations

from kvtier_tools.server import metric_sum, parse_metrics

EXPOSITION = """\
# HELP kvtier:tier_hits_total Chunks read and verified from the tier.
# TYPE kvtier:tier_hits_total counter
kvtier:tier_hits_total{engine="0",model_name="m",tier="s3"} 5.0
kvtier:tier_hits_total{engine="0",model_name="m",tier="disk"} 2.0
kvtier:tier_hits_total{engine="0",model_name="m,tier=\\"s3\\"",tier="cpu"} 7.0
# HELP kvtier:load_seconds Loading the chunks of one step.
# TYPE kvtier:load_seconds histogram
kvtier:load_seconds_bucket{engine="0",le="0.1"} 1.0
kvtier:load_seconds_bucket{engine="0",le="+Inf"} 3.0
kvtier:load_seconds_count{engine="0"} 3.0
kvtier:load_seconds_sum{engine="0"} 0.75
"""


def test_a_label_value_is_matched_whole() -> None:
    samples = parse_metrics(EXPOSITION)
    assert metric_sum(samples, "kvtier:tier_hits_total") == 14.0
    # The third series' model name holds the text tier="s3": a substring match counted it.
    assert metric_sum(samples, "kvtier:tier_hits_total", tier="s3") == 5.0
    assert metric_sum(samples, "kvtier:tier_hits_total", tier="s3", engine="1") == 0.0


def test_histogram_samples_keep_their_suffixes() -> None:
    samples = parse_metrics(EXPOSITION)
    assert metric_sum(samples, "kvtier:load_seconds_count") == 3.0
    assert metric_sum(samples, "kvtier:load_seconds_bucket", le="+Inf") == 3.0
    assert metric_sum(samples, "kvtier:load_seconds") == 0.0
