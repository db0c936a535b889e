"""A family's own engine defaults (config.FAMILY_DEFAULTS): a Gemma 3 gets the settings measured for it, other
families keep EngineConfig's, and whatever the user set (a CLI flag, the app's settings) wins.

The family is read from the loaded model's config, so the tiny checkpoints here carry names that say nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from bench.cli import _configs, _load_engine
from bench.cli import build_parser as bench_parser
from infinigen_core import config as engine_config
from infinigen_core.cli import build_parser as core_parser
from infinigen_core.cli import run_generate
from infinigen_core.config import ConfigError, EngineConfig, FamilyDefaults, with_family_defaults
from infinigen_core.loading import load_engine
from infinigen_core.model_flags import engine_settings

VOCAB = 96
GENERAL = EngineConfig()
GEMMA = {"partial_ratio": 1.0, "budget": 0.1}  # docs/BENCHMARKS.md, "Gemma 3 270M": measured on the real model


def tiny_config(model_type: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "gemma3_text":
        return transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if model_type == "smollm3":
        return transformers.SmolLM3Config(**common, no_rope_layers=[1, 1, 0])
    return transformers.LlamaConfig(**common)  # SmolLM2's family


def save_checkpoint(model_type: str, directory: Path) -> Path:
    """A tiny random model and a word-level tokenizer, built here; the directory's name hides the family."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                                     bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-defaults")
    return {kind: save_checkpoint(kind, root / f"model-{number}")
            for number, kind in enumerate(("gemma3_text", "llama", "smollm3"))}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def load(checkpoint: Path, cache: Path, **kwargs):
    return load_engine(str(checkpoint), device="cpu", cache_dir=cache, compile_decode=False, cpu_kernels=False,
                       progress=lambda message: None, **kwargs)


def tuned(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in GEMMA}


# ------------------------------------------------------------------------------------ the table
def test_the_gemma3_family_takes_the_measured_settings_and_others_keep_the_general_ones():
    for model_type in ("gemma3_text", "gemma3"):  # the text checkpoints and the multimodal ones' language model
        config, applied = with_family_defaults(GENERAL, model_type)
        assert tuned(config) == GEMMA and not config.budget_is_tokens
        assert GENERAL.budget_by_layer and not config.budget_by_layer  # measured better uniform at 16k
        assert applied is not None and applied.kept == () and "Gemma 3 defaults: partial ratio 1, budget 0.1, " \
            "the budget uniform over the layers" in applied.describe()
        general = {name: getattr(GENERAL, name) for name in GEMMA}
        assert config.with_changes(**general, budget_by_layer=True) == GENERAL  # nothing else
    for model_type in ("llama", "smollm3", "qwen3", "gemma2", None):
        assert with_family_defaults(GENERAL, model_type) == (GENERAL, None)


def test_a_setting_the_user_chose_wins_over_the_family_and_is_named():
    mine = GENERAL.with_changes(budget=512, budget_is_tokens=True, partial_ratio=0.25)
    config, applied = with_family_defaults(mine, "gemma3_text", user_settings=["budget"])
    assert (config.budget, config.budget_is_tokens, config.partial_ratio) == (512, True, 1.0)
    assert applied is not None and applied.kept == ("budget",) and "yours kept: budget" in applied.describe()
    config, applied = with_family_defaults(mine, "gemma3_text", user_settings=engine_config.TUNABLE_SETTINGS)
    assert config == mine and applied is not None and applied.applied == ()
    with pytest.raises(ConfigError, match="not a tunable setting: policy"):
        with_family_defaults(mine, "gemma3_text", user_settings=["policy"])


def test_the_family_table_is_checked_by_engine_config():
    assert engine_config.family_defaults("gemma3_text") is engine_config.FAMILY_DEFAULTS[0]
    with pytest.raises(ConfigError, match="partial ratio must be in"):
        FamilyDefaults("Broken", ("llama",), (("partial_ratio", 1.5),), "none")
    with pytest.raises(ConfigError, match="settings must be some of"):
        FamilyDefaults("Broken", ("llama",), (("policy", 1.0),), "none")
    with pytest.raises(ConfigError, match="at least one model_type"):
        FamilyDefaults("Broken", (), (("budget", 0.2),), "none")
    twice = FamilyDefaults("Again", ("gemma3",), (("budget", 0.2),), "none")
    with pytest.raises(ConfigError, match="'gemma3' has defaults twice"):
        engine_config.check_family_table((*engine_config.FAMILY_DEFAULTS, twice))


# ------------------------------------------------------------------------------------ at load
def test_load_engine_applies_them_by_the_loaded_models_config(checkpoints, cache):
    with load(checkpoints["gemma3_text"], cache) as gemma:
        assert tuned(gemma.config) == GEMMA
        assert gemma.family_defaults is not None and gemma.family_defaults.family.label == "Gemma 3"
    for kind in ("llama", "smollm3"):
        with load(checkpoints[kind], cache) as other:
            assert other.config == GENERAL and other.family_defaults is None


def test_at_load_the_users_settings_win_and_a_whole_config_is_taken_as_given(checkpoints, cache):
    mine = GENERAL.with_changes(partial_ratio=0.25, budget=0.3)
    with load(checkpoints["gemma3_text"], cache, config=mine, user_settings=("partial_ratio",)) as engine:
        assert (engine.config.partial_ratio, engine.config.budget) == (0.25, 0.1)
        assert engine.family_defaults.kept == ("partial_ratio",)
    with load(checkpoints["gemma3_text"], cache, config=mine) as engine:  # a script's own config: left whole
        assert engine.config == mine and engine.family_defaults.applied == ()


# ------------------------------------------------------------------------------------ the command lines
def test_the_setting_flags_are_unset_unless_given():
    args = bench_parser().parse_args(["ppl", "--text", "t.txt", "--context", "64"])
    assert all(getattr(args, name) is None for name in engine_config.TUNABLE_SETTINGS)
    assert engine_settings(args) == (GENERAL, ())
    args = core_parser().parse_args(["generate", "--prompt", "hi", "--budget", "300", "--partial-ratio", "0.5"])
    config, chosen = engine_settings(args)
    assert chosen == ("budget", "partial_ratio")
    assert (config.budget, config.budget_is_tokens, config.partial_ratio) == (300, True, 0.5)


def test_the_benchmarks_measure_the_family_defaults_unless_a_flag_says_otherwise(checkpoints, cache, monkeypatch):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(cache))
    model = ["--model", str(checkpoints["gemma3_text"]), "--no-compile", "--no-cpu-kernels"]
    args = bench_parser().parse_args(["ppl", "--text", "t.txt", "--context", "64", "--policies", "full,infinigen",
                                      *model])
    with _load_engine(args) as engine:
        configs = _configs(args, engine)
        assert tuned(configs["infinigen"]) == GEMMA and configs["full"].policy == "full"
    args = bench_parser().parse_args(["ppl", "--text", "t.txt", "--context", "64", "--partial-ratio", "0.5", *model])
    with _load_engine(args) as engine:
        assert tuned(_configs(args, engine)["infinigen"]) == {"partial_ratio": 0.5, "budget": 0.1}


def test_generate_reports_the_defaults_it_ran_with(checkpoints, cache, capsys):
    prompt = " ".join(f"w{i % 80}" for i in range(40))
    common = ["generate", "--model", str(checkpoints["gemma3_text"]), "--prompt", prompt, "--max-new-tokens", "2",
              "--device", "cpu", "--no-compile", "--no-cpu-kernels", "--cache-dir", str(cache)]
    report = run_generate(core_parser().parse_args(common))
    assert tuned_report(report) == GEMMA and report["family_defaults"].startswith("Gemma 3 defaults")
    report = run_generate(core_parser().parse_args([*common, "--budget", "0.5", "--partial-ratio", "0.5"]))
    assert tuned_report(report) == {"partial_ratio": 0.5, "budget": 0.5}
    assert "none applied; yours kept: partial ratio, budget" in report["family_defaults"]
    report = run_generate(core_parser().parse_args([*common, "--model", str(checkpoints["llama"])]))
    assert tuned_report(report) == {"partial_ratio": 0.5, "budget": 0.15} and report["family_defaults"] is None
    capsys.readouterr()


def tuned_report(report: dict) -> dict:
    return {name: report["settings"][name] for name in GEMMA}


# ------------------------------------------------------------------------------------ the app
def shown_form(service, **changes):
    """The settings form as the page shows it (the settings now in use), with `changes` typed in."""
    from chat_service.settings import SettingsForm

    shown = service.settings.current
    values = dict(alpha=shown.alpha, budget=shown.budget, partial_ratio=shown.partial_ratio,
                  min_fetch_tokens=shown.min_fetch_tokens)
    return SettingsForm(**{**values, **changes})


def test_the_app_applies_them_says_so_and_keeps_what_the_user_set_across_models(checkpoints, cache):
    from chat_service import ChatService
    from chat_service.settings import engine_config

    def loader(model, device, config, quantize, progress, **options):  # the app's own config, given whole
        return load(checkpoints[model or "llama"], cache, config=config)

    service = ChatService(cache / "data", loader=loader)
    service.load(progress=lambda message: None)
    try:
        assert service.host.engine.config == GENERAL and "defaults" not in service.host.model_summary()
        service.switch_model("gemma3_text")
        engine = service.host.engine
        assert tuned(engine.config) == GEMMA
        assert "Gemma 3 defaults: partial ratio 1, budget 0.1, the budget uniform over the layers (on gemma-3-270m" \
            in service.host.model_summary()
        shown = service.settings.current
        assert (shown.partial_ratio, shown.budget, shown.chosen) == (1.0, "0.1", ())  # the page shows them

        service.settings.apply(engine, shown_form(service, temperature=0.5))  # nothing tuned changed: still theirs
        assert service.settings.current.chosen == () and engine_config(service.settings.current, engine) == \
            engine.config
        service.settings.apply(engine, shown_form(service, partial_ratio=0.5))  # the general value, typed in: mine
        assert service.settings.current.chosen == ("partial_ratio",)
        assert tuned(engine_config(service.settings.current, engine)) == {"partial_ratio": 0.5, "budget": 0.1}

        service.switch_model(service.host.DEFAULT_CHOICE)  # Gemma's budget does not follow to another family
        assert service.host.engine.config == GENERAL and service.settings.current.budget == "0.15"
        service.switch_model("gemma3_text")
        assert tuned(service.host.engine.config) == {"partial_ratio": 0.5, "budget": 0.1}
        assert "Gemma 3 defaults: budget 0.1, the budget uniform over the layers; yours kept: partial ratio" in \
            service.host.model_summary()
    finally:
        if service.open_sessions.page is not None:
            service.open_sessions.page.close()
        service.host.engine.close()
