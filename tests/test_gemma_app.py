"""A Gemma 3 in the app (issue 31): the panels, the context meter and the status line tell its sliding-window
layers (they read their window, whatever the policy) from its global layers (the only ones InfiniGen selects
on), and a follow-up question about an attached file says that the file was not read again.

A tiny random-weight Gemma 3 built from its config (6 layers, the real model's 5 sliding : 1 global, a window
of 8 tokens) and a word-level tokenizer without a chat template, loaded as the app loads a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from documents import convert_bytes
from infinigen_core.config import EngineConfig, SamplingConfig
from infinigen_core.generation import generate
from infinigen_core.loading import load_engine
from ui import panels
from ui.page_text import context_meter, layers_read

from conftest import make_tiny_engine, random_tokens

VOCAB = 96
WINDOW = 8
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]  # layer 5 is the global one
SELECTING = EngineConfig(budget=0.25, min_fetch_tokens=0)
WORDS = [f"w{i}" for i in range(VOCAB - 4)]


def save_gemma(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = ["<unk>", "<pad>", "<s>", "</s>"] + WORDS
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocabulary)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                                     bos_token="<s>", eos_token="</s>")
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=1024,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, pad_token_id=1, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_gemma(tmp_path_factory.mktemp("tiny-gemma3"))


def load(checkpoint: Path, cache: Path, config: EngineConfig | None = None):
    return load_engine(str(checkpoint), device="cpu", cache_dir=cache, compile_decode=False, cpu_kernels=False,
                       progress=lambda message: None, config=config)


@pytest.fixture(scope="module")
def selecting_engine(checkpoint, tmp_path_factory):
    """Selecting 25% of the global layer's past from the first decode step: 120 tokens read, 4 generated."""
    engine = load(checkpoint, tmp_path_factory.mktemp("cache"), SELECTING)
    prompt = random_tokens(120, seed=3, vocab=VOCAB)
    list(generate(engine, prompt, SamplingConfig(max_new_tokens=4, temperature=0.0)))
    return engine


def test_the_fetch_panel_shows_the_sliding_layers_window_apart_from_the_global_layers_selection(selecting_engine):
    data = panels.collect(selecting_engine)
    frame, caption = panels.fetch_table(data)
    sliding = frame[frame["series"] == panels.SLIDING_SERIES]
    latest = frame[frame["series"] == "latest step"]
    mean = frame[frame["series"] == "running mean"]
    assert sliding["layer"].tolist() == [0, 1, 2, 3, 4] and set(sliding["kind"]) == {f"sliding {WINDOW}"}
    assert latest["layer"].tolist() == mean["layer"].tolist() == [5] and latest["kind"].tolist() == ["global"]
    context = selecting_engine.num_tokens - 1  # the past of the latest decode step
    assert sliding["fetched / context"].tolist() == pytest.approx([(WINDOW - 1) / context] * 5, abs=1e-4)
    assert latest["fetched / context"].tolist() == pytest.approx([np.ceil(0.25 * context) / context], abs=1e-4)
    window_share = 100 * (WINDOW - 1) / context
    assert (f"global layers 5: a selection, {100 * np.ceil(0.25 * context) / context:.1f}% of the context "
            f"fetched; sliding-window layers 0-4: read their last {WINDOW} tokens, {window_share:.1f}% of the "
            f"context (a window, not a selection)") in caption


def heat_map_pixels(view_html: str) -> np.ndarray:
    from test_panels import heat_map_pixels as decode

    return decode(view_html)


def test_the_heat_map_draws_the_sliding_layers_in_grey_and_the_global_layer_in_colour(selecting_engine):
    data = panels.collect(selecting_engine)
    view, caption = panels.sparsity_view(data)
    pixels = heat_map_pixels(view).astype(int)
    assert pixels.shape[0] == 6
    for layer in range(5):  # grey: red, green and blue alike
        assert (pixels[layer, :, 0] == pixels[layer, :, 1]).all() and (pixels[layer, :, 1] == pixels[layer, :, 2]).all()
    assert pixels[5].tolist() == panels.heat_colours(data.sparsity[5]).tolist()
    assert "sliding-window layers, in grey (their window over the context, not a selection): 0-4" in caption
    assert "sliding window</span>" in view


def test_a_dense_policy_or_a_dense_global_layer_is_said_to_read_the_whole_context():
    data = panels.PanelData(latest_ratio=[0.5, 1.0, 0.5, 1.0], mean_ratio=[0.5, 1.0, 0.5, 1.0], policy="full",
                            layer_kinds=["sliding 4", "global", "sliding 4", "global"], windows=[4, None, 4, None],
                            selecting=[False, False, False, False])
    assert "global layers 1, 3: read the whole context; sliding-window layers 0, 2: read their last 4 tokens, " \
           "50.0% of the context" in panels.fetch_table(data)[1]
    data.selecting = [False, False, False, True]  # the first global layer is one of the dense first layers
    data.latest_ratio[3] = 0.25
    caption = panels.fetch_table(data)[1]
    assert "global layers 3: a selection, 25.0% of the context fetched; global layers 1: read the whole context" \
        in caption


def test_layer_lists_are_written_as_ranges():
    assert panels.layer_ranges([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12]) == "0-4, 6-10, 12"
    assert panels.layer_ranges([5, 11, 17]) == "5, 11, 17" and panels.layer_ranges([]) == ""
    assert panels.layer_ranges([0, 1, 3, 4, 5]) == "0, 1, 3-5"
    assert panels.windows_text([512, 512, None]) == "512" and panels.windows_text([4096, 512]) == "512 or 4,096"


def test_the_context_meter_says_what_each_kind_of_layer_reads(selecting_engine, checkpoint, tmp_path):
    assert layers_read(selecting_engine, 120) == (
        f" · 5 of 6 layers read only the last {WINDOW} tokens (a sliding window); InfiniGen fetches up to 30 of "
        f"the 120 on the other 1 (global: 5)")
    assert "(a sliding window, all of them so far)" in layers_read(selecting_engine, WINDOW)
    shares, selecting_engine.policy.budget_shares = selecting_engine.policy.budget_shares, {5: 2.0}
    try:  # a budget spread over the layers (budget_shares.py), the global layer given twice its share: its rows
        assert "InfiniGen fetches up to 60 of the 120" in layers_read(selecting_engine, 120)
    finally:
        selecting_engine.policy.budget_shares = shares
    assert layers_read(selecting_engine, 0) == (f" · 5 of 6 layers read only the last {WINDOW} tokens (a sliding "
                                                f"window); the other 1 (global: 5) read every token")  # a new chat
    at_the_defaults = load(checkpoint, tmp_path)  # a floor of 256 tokens: a 120-token chat is read whole
    assert layers_read(at_the_defaults, 120).endswith("; the other 1 (global: 5) read all 120")
    assert "fetches up to 256 of the 1,000" in layers_read(at_the_defaults, 1000)


def test_a_model_without_sliding_layers_adds_nothing_to_the_meter(tiny_llama):
    assert layers_read(make_tiny_engine(tiny_llama), 500) == ""


def test_a_follow_up_about_an_attached_file_says_the_file_was_not_read_again(checkpoint, tmp_path):
    """Through the page's own send handler: the first turn reads the file, the follow-up reads only itself, and
    the note under the box, the context meter and the status line say so in words."""
    from chat_service import ChatService
    from ui.page_actions import PageActions

    engine = load(checkpoint, tmp_path / "cache")
    service = ChatService(tmp_path / "data", loader=lambda *args, **kwargs: engine)
    service.load(progress=lambda message: None)
    assert service.host.load_error is None, service.host.load_error
    service.settings.current.sampling = SamplingConfig(max_new_tokens=3, temperature=0.0)
    actions = PageActions(service, tmp_path / "export")
    text = " ".join(WORDS[i % len(WORDS)] for i in range(150))
    actions.pending = [convert_bytes("notes.txt", text.encode())]  # as "New chat about this file" attaches it

    first = list(actions.send("w1 w2 w3"))[-1][2]
    assert first.startswith("Read all ") and "tokens of this prompt once" in first
    document_turn = service.open_sessions.page.last_read_tokens
    assert document_turn > 150

    follow = list(actions.send("w4 w5"))[-1][2]
    read = service.open_sessions.page.last_read_tokens
    assert read < 30 and follow.startswith(f"Read {read:,} new tokens; the other ")
    assert "(this chat's earlier turns, their file included) were not read again: their KV is held." in follow

    meter = context_meter(service)
    assert f"5 of 6 layers read only the last {WINDOW} tokens (a sliding window)" in meter
    assert "the other 1 (global: 5) read all" in meter  # under the 256-token floor: read whole
    assert service.host.ready_line() == (f"Ready: {engine.model_name} on cpu · 1,024-token window · a base model: "
                                         f"it continues text, so its chat answers will be weak")


def test_the_model_picker_names_a_cached_packaged_model_with_what_it_is(tmp_path, monkeypatch):
    from chat_service.model_host import ModelHost
    from infinigen_core.packaged import PACKAGED_MODELS, cached_packaged_models

    gemma = PACKAGED_MODELS["gemma-3-270m"]
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    assert cached_packaged_models() == []
    assert ModelHost("gemma-3-270m").model_choices()[-1] == (gemma.picker_label(), "gemma-3-270m")  # not fetched yet
    gemma.cached_file(tmp_path).parent.mkdir(parents=True)
    gemma.cached_file(tmp_path).write_bytes(b"GGUF")
    assert cached_packaged_models() == [gemma]
    choices = ModelHost().model_choices()
    label = dict((value, label) for label, value in choices)["gemma-3-270m"]
    assert label == "gemma-3-270m · base model, continues text (chat answers will be weak) · 32k window"
    assert [value for _, value in ModelHost("gemma-3-270m").model_choices()].count("gemma-3-270m") == 1
