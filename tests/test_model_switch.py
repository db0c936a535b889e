"""Switching models keeps each model's KV chunks of a session: switching back restores, never re-reads."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from infinigen_core.calibration import calibrate
from infinigen_core.config import EngineConfig, SamplingConfig
from infinigen_core.engine import InfiniGenEngine
from sessions import ChatSession, SessionStore

SHORT = SamplingConfig(max_new_tokens=5)


def run_turn(chat, text):
    return list(chat.send(text, SHORT))[-1].full_text


@pytest.fixture(scope="module")
def other_engine(real_engine_shared):
    """A second model: a tiny random Qwen3 sharing the real tokenizer (so the same chat can run on both)."""
    torch.manual_seed(0)
    tokenizer = real_engine_shared.tokenizer
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=2048)).eval()
    skew = calibrate(model, tokenizer("A short text to calibrate a tiny model on. " * 8)["input_ids"])
    engine = InfiniGenEngine(model, tokenizer, EngineConfig(), skew_set=skew, fingerprint="tiny-qwen3")
    yield engine
    engine.close()


def test_switching_back_restores_each_models_own_cache(tmp_path, real_engine, other_engine):
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Switching", system_prompt="You are terse.")
    with ChatSession.open(store, real_engine, session_id) as chat:
        run_turn(chat, "What is the capital of France?")
        tokens_a = list(real_engine.token_ids)

    with ChatSession.open(store, other_engine, session_id) as chat:  # another model: re-read, and say why
        assert chat.restore.rebuilt and "another model" in chat.restore.reason
        assert chat.restore.tokens_prefilled == len(chat._conversation_ids()) and chat.restore.tokens_restored == 0
    assert store.parked.models(session_id) == [real_engine.fingerprint]

    with ChatSession.open(store, real_engine, session_id) as chat:  # back: from disk, nothing recomputed
        # (but the chat template's end-of-turn tokens after the reply, which no reply generates itself)
        assert not chat.restore.rebuilt and chat.restore.tokens_prefilled <= 3
        assert chat.restore.tokens_restored == len(tokens_a) and real_engine.token_ids[: len(tokens_a)] == tokens_a
    assert store.parked.models(session_id) == ["tiny-qwen3"]

    with ChatSession.open(store, other_engine, session_id) as chat:  # and the other model's cache came back too
        assert not chat.restore.rebuilt and chat.restore.tokens_prefilled == 0
        assert chat.restore.tokens_restored == len(chat._conversation_ids())
        restored_here = chat.restore.tokens_restored
        run_turn(chat, "And of Italy?")  # the conversation goes on under this model
        total = other_engine.num_tokens

    with ChatSession.open(store, real_engine, session_id) as chat:
        # its own cache for the first turn, only the turn said under the other model is read
        assert not chat.restore.rebuilt and chat.restore.tokens_restored >= len(tokens_a)
        assert 0 < chat.restore.tokens_prefilled <= total - restored_here + 3
        assert real_engine.token_ids == chat._conversation_ids()
    real_engine.reset()
    with ChatSession.open(store, real_engine, session_id) as chat:  # what it read was saved
        assert chat.restore.tokens_prefilled == 0 and chat.restore.tokens_restored == len(real_engine.token_ids)

    files = list((store.data_dir / "kv" / session_id).iterdir())
    assert len(files) >= 3  # both models' chunks are on disk
    store.delete(session_id)
    assert not (store.data_dir / "kv" / session_id).exists()  # parked chunks go with the session
    real_engine.reset()


def test_the_app_controller_switches_models_and_back(tmp_path, real_engine_shared):
    """The model picker's path: unload, load another, reopen the session under it; a bad choice goes back."""
    from chat_service import ChatService, UserError
    from infinigen_core.loading import ModelLoadError

    real = real_engine_shared
    loaded = []

    def loader(model, device, config, quantize, progress):
        if model is None:
            engine = InfiniGenEngine(real.model, real.tokenizer, config, skew_set=real.skew_set,
                                     fingerprint=real.fingerprint)
            engine.model_name = "SmolLM2-135M-Instruct"
        elif model == "tiny-org/Tiny-Qwen3":
            torch.manual_seed(0)
            tiny = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(real.tokenizer), hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=16, max_position_embeddings=2048)).eval()
            skew = calibrate(tiny, real.tokenizer("Calibration text for a tiny model. " * 8)["input_ids"])
            engine = InfiniGenEngine(tiny, real.tokenizer, config, skew_set=skew, fingerprint="tiny-qwen3")
            engine.model_name = model
        else:
            raise ModelLoadError(f"model path {model} does not exist")
        loaded.append(model)
        return engine

    controller = ChatService(tmp_path / "data", loader=loader)
    controller.settings.current.sampling = SHORT
    controller.load(progress=lambda message: None)
    try:
        list(controller.page_turns.send("What is the capital of France?"))
        first_tokens = controller.host.engine.num_tokens

        message = controller.switch_model("tiny-org/Tiny-Qwen3")
        assert message.startswith("Switched to tiny-org/Tiny-Qwen3 · Qwen3 · 4 global layers · float32 on cpu")
        assert "another model" in controller.pages.restore_message and "rebuilt it by re-reading" in controller.pages.restore_message
        assert len(controller.pages.chat_history()) == 2 and controller.host.engine.num_tokens >= first_tokens

        controller.switch_model(controller.host.DEFAULT_CHOICE)
        assert controller.pages.restore_message.startswith(f"Restored {first_tokens} tokens")
        assert controller.host.engine.model_name == "SmolLM2-135M-Instruct"

        with pytest.raises(UserError, match="Could not load /no/such/model.*Back on SmolLM2-135M-Instruct"):
            controller.switch_model("/no/such/model")
        assert controller.host.engine.model_name == "SmolLM2-135M-Instruct" and len(controller.pages.chat_history()) == 2
        assert loaded == [None, "tiny-org/Tiny-Qwen3", None, None]  # the failed one, then the old one again
        assert controller.host.model_choices()[0] == ("SmolLM2-135M-Instruct (default)", "default")
    finally:
        if controller.open_sessions.page is not None:
            controller.open_sessions.page.close()
        controller.host.engine.close()

    # a model that failed at start: the picker is the way out
    stuck = ChatService(tmp_path / "data", model="/no/such/model", loader=loader)
    stuck.load(progress=lambda message: None)
    assert stuck.host.engine is None and "does not exist" in stuck.host.load_error
    try:
        assert stuck.switch_model(stuck.host.DEFAULT_CHOICE).startswith("Switched to SmolLM2-135M-Instruct")
        assert stuck.host.load_error is None and len(stuck.pages.chat_history()) == 2  # the latest session, reopened
    finally:
        stuck.open_sessions.page.close()
        stuck.host.engine.close()


def test_the_apps_host_sets_the_loaded_heap_aside_and_takes_it_back_to_let_an_old_model_go(tiny_llama):
    """`settles_heap` (app.py sets it): after a load every tracked object is frozen out of the collector's full
    passes (0.3-0.4 s with a real model, mid-reply); before a switch unloads, they are taken back, or the old
    engine's reference cycles could never be collected."""
    import gc
    import weakref

    from chat_service.model_host import ModelHost

    from conftest import make_tiny_engine

    made = []

    def loader(model, **kwargs):
        engine = make_tiny_engine(tiny_llama)
        engine.held_in_a_cycle = [engine]  # only the cyclic collector can free it
        made.append(weakref.ref(engine))
        return engine

    host = ModelHost(loader=loader)
    host.settles_heap = True
    try:
        host.load(lambda: EngineConfig(), progress=lambda message: None)
        assert host.is_ready() and gc.get_freeze_count() > 0
        assert host.swap("another", lambda: EngineConfig(), progress=lambda message: None) is None
        assert made[0]() is None and made[1]() is host.engine  # the first engine was let go in the switch
        assert gc.get_freeze_count() > 0  # and the new model's heap set aside again
    finally:
        gc.unfreeze()
    assert ModelHost().settles_heap is False  # a test's or a library's host leaves the heap alone
