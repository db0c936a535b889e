"""Skew matrices: orthogonal, QKᵀ-preserving, energy-concentrating, cached on disk."""

import torch

from infinigen_core.calibration import RECORDING_ATTENTION
from infinigen_core.skew import SkewSet, load_skew, save_skew, skew_from_states

from conftest import random_tokens


def test_skews_are_orthogonal(tiny_llama, tiny_opt):
    for _, skew_set in (tiny_llama, tiny_opt):
        for skew in skew_set.skews:
            eye = torch.eye(skew.shape[-1]).expand_as(skew)
            torch.testing.assert_close(skew @ skew.transpose(1, 2), eye, atol=1e-5, rtol=0)


def _recorded_states(model, tokens):
    recorder = {}
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDING_ATTENTION)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]), use_cache=False, calibration_recorder=recorder)
    finally:
        model.set_attn_implementation(previous)
    return recorder


def test_skew_leaves_attention_logits_unchanged(tiny_llama):
    model, skew_set = tiny_llama
    queries, keys = _recorded_states(model, random_tokens(64, seed=9))[2]  # held-out text, layer 2
    group = queries.shape[0] // keys.shape[0]
    for kv in range(keys.shape[0]):
        skew = skew_set.skews[2][kv]
        q, k = queries[kv * group], keys[kv]
        torch.testing.assert_close((q @ skew) @ (k @ skew).T, q @ k.T, atol=1e-4, rtol=1e-4)


def test_skew_packs_a_low_rank_query_into_leading_channels():
    torch.manual_seed(0)
    dim, rank = 32, 3
    basis = torch.randn(rank, dim)
    queries = (torch.randn(2, 200, rank) @ basis)  # two query heads of one KV head, rank 3
    keys = torch.randn(1, 200, dim)
    skews, scores = skew_from_states(queries, keys, group_size=2)
    skewed = queries.reshape(-1, dim) @ skews[0]
    energy = skewed.pow(2).sum(0)
    assert energy[:rank].sum() / energy.sum() > 0.999  # all energy in `rank` channels
    assert energy[rank:].max() < 1e-6 * energy.sum()
    # raw channels spread it: no 3 of them carry nearly everything
    raw = queries.reshape(-1, dim).pow(2).sum(0)
    assert raw.topk(rank).values.sum() / raw.sum() < 0.9
    assert scores.shape == (1, dim)


def test_short_calibration_still_gives_square_orthogonal_skews():
    queries, keys = torch.randn(2, 5, 16), torch.randn(1, 5, 16)  # 10 rows < 16 channels
    skews, _ = skew_from_states(queries, keys, group_size=2)
    torch.testing.assert_close(skews[0] @ skews[0].T, torch.eye(16), atol=1e-5, rtol=0)


def test_partial_projection_keeps_the_strongest_channels(tiny_llama):
    _, skew_set = tiny_llama
    projection = skew_set.partial_projection(3, 0.25)
    skew, scores = skew_set.skews[3], skew_set.channel_scores[3]
    assert projection.shape == (skew.shape[0], skew.shape[1], skew.shape[1] // 4)
    for kv in range(skew.shape[0]):
        chosen = scores[kv].topk(projection.shape[-1]).indices
        torch.testing.assert_close(projection[kv], skew[kv][:, chosen])


def test_skew_cache_round_trip_and_damage(tmp_path, tiny_llama):
    _, skew_set = tiny_llama
    path = tmp_path / "skew.safetensors"
    save_skew(path, skew_set, {"fingerprint": "tiny"})
    loaded = load_skew(path, len(skew_set.skews))
    assert isinstance(loaded, SkewSet) and loaded.fingerprint() == skew_set.fingerprint()
    path.write_bytes(path.read_bytes()[:100])  # truncated file: recalibrate rather than crash
    assert load_skew(path, len(skew_set.skews)) is None
    assert load_skew(tmp_path / "missing.safetensors", 4) is None
