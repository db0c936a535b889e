"""The predicted GPU table: bytes per policy follow the model's shape, and the ratios move the right way."""

import json
from dataclasses import replace

import pytest

from bench.gpu import SHAPES
from bench.gpu_predict import (
    PROFILES,
    kv_bytes_per_token_layer,
    predict_step,
    predict_table,
    profile_named,
    weight_bytes,
)


def test_weight_and_kv_bytes_match_the_published_shapes():
    # Llama-2-7B has 6.74e9 parameters and Llama-3-8B 8.03e9 (embeddings counted once, read once per step here)
    assert weight_bytes(SHAPES["llama2-7b"]) / 2 == pytest.approx(6.74e9 - 32000 * 4096, rel=0.01)
    assert weight_bytes(SHAPES["llama3-8b"]) / 2 == pytest.approx(8.03e9 - 128256 * 4096, rel=0.01)
    assert kv_bytes_per_token_layer(SHAPES["llama2-7b"]) == 2 * 32 * 128 * 2  # K and V, 32 heads, fp16
    assert kv_bytes_per_token_layer(SHAPES["llama3-8b"]) == 2 * 8 * 128 * 2  # GQA: 8 KV heads


def test_policies_fetch_what_they_should():
    shape, profile, context = SHAPES["llama3-8b"], PROFILES["h100"], 16384
    per_layer = kv_bytes_per_token_layer(shape)
    offload = predict_step(shape, context, "offload", 0.1, profile)
    infinigen = predict_step(shape, context, "infinigen", 0.1, profile)
    # the pool holds the new token when a layer is fetched; InfiniGen's 2 dense layers stay on the GPU and
    # move nothing, its 30 sparse layers fetch ceil(0.1 x 16384) rows
    # the fair offload gets InfiniGen's GPU memory for the KV: its 2 dense layers, the partial keys (half of
    # each sparse layer's keys: a quarter of its K/V, 7.5 layers) and the two gather buffers (2 x 1640 rows,
    # 0.2 layer): 9 whole layers fit, the other 23 are copied whole
    assert infinigen["resident_layers"] == 2
    assert offload["resident_layers"] == int(2 + 30 * 0.25 + 2 * 1640 / context) == 9
    assert offload["bytes_fetched_per_token"] == (context + 1) * per_layer * 23
    with pytest.raises(ValueError, match="budget"):
        predict_step(shape, context, "offload", None, profile)
    assert infinigen["bytes_fetched_per_token"] == 30 * 1639 * per_layer
    assert predict_step(shape, context, "full", None, profile)["bytes_fetched_per_token"] == 0


def test_ratios_move_with_context_and_link():
    table = predict_table(["llama2-7b"], [4096, 32768], ["full", "offload", "hf-offload", "infinigen"], [0.1],
                          PROFILES["h100"])
    rows = {(r["context"], r["policy"]): r for r in table["rows"]}
    for context in (4096, 32768):
        assert rows[context, "full"]["ratio_to_full"] == 1
        # transformers' offloading copies pinned and overlapped too, but every layer; offload only those it does
        # not keep (the layers that fit in InfiniGen's memory): per layer copied no faster than offload, not far slower
        copied = 32 - rows[context, "offload"]["resident_layers"]
        assert copied == 23
        assert 1 <= rows[context, "offload"]["speedup_vs_hf_offload"] <= 32 / copied
        assert rows[context, "offload"]["speedup_vs_hf_offload"] * copied / 32 >= 0.8
        # its prefetch circles back: layer 0's copy starts in the previous step's last layer, so nothing waits
        # for a first copy, and a copy-bound step is its 32 copies and nothing more (offload's first copy waits)
        copy_ms = (context + 1) * kv_bytes_per_token_layer(SHAPES["llama2-7b"]) / 50e9 * 1e3
        assert copy_ms > PROFILES["h100"].host_ms_per_layer  # copy-bound at both contexts
        assert rows[context, "hf-offload"]["ms_per_token"] == pytest.approx(32 * copy_ms)
    # fetching a tenth beats fetching every layer offload does not keep once the copies dominate; at 4k both sit
    # near the eager launch floor, where offload's resident layers (equal memory) bring it level
    assert rows[32768, "infinigen"]["speedup_vs_offload"] > 2
    assert rows[4096, "infinigen"]["speedup_vs_offload"] == pytest.approx(1, abs=0.05)
    # the cache's share of the step grows with the context: every offloading policy falls behind `full`
    assert rows[32768, "offload"]["ratio_to_full"] < rows[4096, "offload"]["ratio_to_full"]
    # a faster DMA link helps offload more than InfiniGen, whose scattered zero-copy reads keep their own rate
    fast = predict_table(["llama2-7b"], [32768], ["offload", "infinigen"], [0.1], profile_named("h100", 200.0))
    fast_rows = {r["policy"]: r for r in fast["rows"]}
    assert fast_rows["infinigen"]["speedup_vs_offload"] < rows[32768, "infinigen"]["speedup_vs_offload"]


def test_the_zero_copy_fetch_drops_the_host_gather_and_round_trip():
    """The same bytes either way; staged adds the host's gather and round trip to every sparse layer, zero-copy
    only waits where the GPU's own gather is slower than the layer (a slow scattered-read rate)."""
    shape, context = SHAPES["llama3-8b"], 32768
    zero_copy = predict_step(shape, context, "infinigen", 0.15, PROFILES["h100"])
    staged = predict_step(shape, context, "infinigen", 0.15, PROFILES["h100"], fetch="staged")
    assert zero_copy["bytes_fetched_per_token"] == staged["bytes_fetched_per_token"]
    rows_s = 4916 * kv_bytes_per_token_layer(shape) / 25e9
    gather_s = 4916 * kv_bytes_per_token_layer(shape) / (PROFILES["h100"].host_gather_gbps * 1e9)
    assert staged["ms_per_token"] - zero_copy["ms_per_token"] >= 30 * (gather_s + 0.05e-3) * 1e3 * 0.99
    slow = predict_step(shape, context, "infinigen", 0.15, replace(PROFILES["h100"], zero_copy_gather_gbps=5.0))
    assert slow["ms_per_token"] == pytest.approx(2 * 0.6 + 30 * rows_s * 5 * 1e3, rel=0.01)
    with pytest.raises(ValueError, match="unknown fetch"):
        predict_step(shape, context, "infinigen", 0.15, PROFILES["h100"], fetch="magic")


def test_the_eager_launch_floor_bounds_short_contexts():
    """At a short context every policy sits on the host's launches: InfiniGen cannot beat `full` there."""
    table = predict_table(["llama3-8b"], [1024], ["full", "infinigen"], [0.1], PROFILES["h100"])
    rows = {r["policy"]: r for r in table["rows"]}
    assert rows["full"]["ms_per_token"] == pytest.approx(32 * PROFILES["h100"].host_ms_per_layer)
    assert rows["infinigen"]["ratio_to_full"] < 1


def test_measured_rates_replace_the_stated_ones(tmp_path):
    rates = tmp_path / "probe.json"
    rates.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3",
                                 "rates": {"host_gather_gbps": 50.0, "pinned_h2d_gbps": 25.0, "unknown": 1}}))
    profile = profile_named(str(rates))
    assert profile.host_gather_gbps == 50.0 and profile.pinned_h2d_gbps == 25.0 and profile.rates == str(rates)
    assert profile.hbm_gbps == PROFILES["h100"].hbm_gbps  # not measured: stated
    rates.write_text("{}")
    with pytest.raises(ValueError, match="no rates"):
        profile_named(str(rates))


def test_unknown_profile_is_refused():
    with pytest.raises(ValueError, match="h100"):
        profile_named("tpu")
