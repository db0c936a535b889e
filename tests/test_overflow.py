"""When the chat outgrows the window: whole turns dropped (the oldest, or the middle ones), the KV kept consistent
with what is left, the setting on the page, the context meter, and the API left to its client. Also at the
window's edge: the refusal when even a file's passages do not fit, and a file repeated in a conversation.

A tiny random Llama with a 160-token window and a word-level chat tokenizer: a few turns outgrow it, and greedy
replies are exact, so "the same as a fresh engine reading the shortened conversation" is an equality.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from chat_service import ChatService, UserError
from chat_service.settings import SettingsForm
from documents import Document
from infinigen_core import EngineConfig, SamplingConfig, chat_token_ids, generate
from infinigen_core.engine import InfiniGenEngine
from sessions import ChatSession, ContextWindowError, SessionStore
from sessions.chat import conversation
from sessions.overflow import Cut, check_overflow, turns_kept
from ui.api.protocol import ApiError, ChatRequest
from ui.api.serving import checked_prompt_ids
from ui.page_text import context_meter

WINDOW = 160  # the reply reserve (64) leaves 96 tokens for the conversation: about three of these turns
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue amber").split()
SPECIALS = ("<|im_start|>", "<|im_end|>")
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
GREEDY = SamplingConfig(max_new_tokens=4)


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIALS + ("[UNK]", "system", "user", "assistant") + tuple(WORDS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", unk_token="[UNK]",
                                        chat_template=TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=WINDOW,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval(), tokenizer


def small_engine(model_and_tokenizer) -> InfiniGenEngine:
    model, tokenizer = model_and_tokenizer
    return InfiniGenEngine(model, tokenizer, EngineConfig(policy="full"), fingerprint="tiny-words")


def words(seed: int, count: int = 16) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(count))


def reply_of_fresh_engine(model_and_tokenizer, system: str, turns: list[tuple[str, str]]):
    """What an engine that never saw the dropped turns answers to `turns`: (reply text, token ids after it)."""
    engine = small_engine(model_and_tokenizer)
    prompt = chat_token_ids(engine.tokenizer, conversation(system, turns), add_generation_prompt=True)
    events = list(generate(engine, prompt, GREEDY))
    return events[-1].full_text, list(engine.token_ids)


def test_turns_kept_drops_whole_turns_and_keeps_the_last_one():
    said = [SimpleNamespace(role=role, n=n) for n, role in enumerate("user assistant user assistant user assistant "
                                                                       "user".split())]
    short_enough = lambda kept: len(kept) <= 3  # noqa: E731
    oldest = turns_kept(said, short_enough)
    assert oldest is not None and [m.n for m in oldest.kept] == [4, 5, 6]  # two whole turns went, the oldest first
    assert [m.n for m in oldest.dropped] == [0, 1, 2, 3]
    middle = turns_kept(said, lambda kept: len(kept) <= 4, keep_first=True)
    assert middle is not None and [m.n for m in middle.kept] == [0, 1, 6]
    assert [m.n for m in middle.dropped] == [2, 3, 4, 5]
    assert turns_kept(said, lambda kept: len(kept) <= 3, keep_first=True) == Cut([said[0], said[1], said[6]],
                                                                                  said[2:6])
    assert turns_kept(said, lambda kept: len(kept) <= 2, keep_first=True) is None  # the first and last stay
    assert turns_kept(said, lambda kept: False) is None and turns_kept(said, lambda kept: True) == Cut(said, [])
    long = [SimpleNamespace(role=("user", "assistant")[n % 2], n=n) for n in range(2 * 64)]  # 64 turns
    counted = []

    def counting(kept):  # the cut is halved for: log2(64) checks after the whole conversation's
        counted.append(len(kept))
        return len(kept) <= 21
    assert [m.n for m in turns_kept(long, counting).kept] == list(range(108, 128)) and len(counted) == 1 + 6
    assert check_overflow("Keep the first turn, drop the middle") == "keep_first" == check_overflow(" keep_first ")
    with pytest.raises(ValueError, match="When the chat outgrows the window"):
        check_overflow("drop everything")


@pytest.mark.parametrize("keep_first", [False, True])
def test_a_session_with_turns_dropped_answers_as_if_they_were_never_said_and_reopens_shortened(
        tmp_path, model_and_tokenizer, keep_first):
    store, system = SessionStore(tmp_path / "data"), "blue amber"
    session_id = store.create("Overflow", system_prompt=system)
    engine = small_engine(model_and_tokenizer)
    with ChatSession.open(store, engine, session_id) as chat:
        for seed in range(3):
            list(chat.send(words(seed), GREEDY))
        new = words(9)
        assert not chat.check_window(new).fits
        gone = chat.fit_window(new, keep_first=keep_first)
        assert [m.content for m in gone if m.role == "user"] == [words(1) if keep_first else words(0)]
        kept = [(m.role, m.content) for m in chat.messages]
        assert (kept[0][1] == words(0)) is keep_first and kept[-2][1] == words(2)
        reply = list(chat.send(new, GREEDY))[-1].full_text
        expected_reply, expected_ids = reply_of_fresh_engine(model_and_tokenizer, system, kept + [("user", new)])
        assert reply == expected_reply and engine.token_ids == expected_ids  # no dropped token is attended to
        shortened = [(m.role, m.content) for m in chat.messages]
    reopened_engine = small_engine(model_and_tokenizer)
    with ChatSession.open(store, reopened_engine, session_id) as chat:
        assert [(m.role, m.content) for m in chat.messages] == shortened == kept + [("user", new), ("assistant", reply)]
        assert chat.restore.tokens_restored == len(expected_ids) and not chat.restore.rebuilt
        assert reopened_engine.token_ids == expected_ids
        follow_up = list(chat.send(words(4, 4), GREEDY))[-1].full_text
    assert follow_up == reply_of_fresh_engine(model_and_tokenizer, system, shortened + [("user", words(4, 4))])[0]


def test_nothing_is_dropped_when_even_the_shortest_history_does_not_fit(tmp_path, model_and_tokenizer):
    store = SessionStore(tmp_path / "data")
    session_id = store.create("Too long")
    with ChatSession.open(store, small_engine(model_and_tokenizer), session_id) as chat:
        for seed in range(2):
            list(chat.send(words(seed), GREEDY))
        with pytest.raises(ContextWindowError):
            chat.fit_window(words(5, 90))
        assert len(chat.messages) == 4


@pytest.fixture
def service(tmp_path, model_and_tokenizer):
    engine = small_engine(model_and_tokenizer)
    controller = ChatService(tmp_path / "data", loader=lambda *args, **kwargs: engine)
    controller.load(progress=lambda message: None)
    assert controller.host.load_error is None, controller.host.load_error
    return controller


def page_send(service: ChatService, text: str) -> list[dict]:
    history: list[dict] = []
    for history in service.page_turns.send(text):
        pass
    return history


def apply_overflow(service: ChatService, overflow: str) -> str:
    return service.settings.apply(service.host.engine, SettingsForm(policy="full", overflow=overflow,
                                                                    max_new_tokens=4))


def test_the_page_setting_stops_and_asks_by_default_then_drops_turns_and_the_meter_names_them(service):
    apply_overflow(service, "stop")
    for seed in range(3):
        page_send(service, words(seed))
    chat = service.open_sessions.page
    assert "Context:" in context_meter(service) and "out of the window" not in context_meter(service)
    with pytest.raises(UserError, match="When the chat outgrows the window"):  # says the setting exists
        page_send(service, words(9, 20))
    assert len(chat.messages) == 6  # nothing sent or lost
    with pytest.raises(UserError, match="When the chat outgrows the window"):
        apply_overflow(service, "sometimes")  # validated in one place, the old setting kept
    assert "drop the oldest turns" in apply_overflow(service, "Drop the oldest turns")
    shown = page_send(service, words(9, 20))
    assert [m["content"] for m in shown if m["role"] == "user"] == [words(1), words(2), words(9, 20)]
    meter = context_meter(service)
    assert "1 turn out of the window" in meter and words(0)[:20] in meter and words(1)[:20] not in meter
    assert service.store.get(chat.id).settings["overflow"] == "drop_oldest"  # kept with the session's settings
    apply_overflow(service, "keep_first")
    page_send(service, words(10, 20))
    assert [m.content for m in chat.messages if m.role == "user"][0] == words(1)  # the first left now stays
    assert "2 turns out of the window" in context_meter(service)


def test_the_meter_counts_what_the_model_read_and_tokenizes_only_once_turns_are_dropped(service, tmp_path):
    from ui.page_actions import PageActions

    apply_overflow(service, "stop")
    for seed in range(3):
        page_send(service, words(seed))
    chat, engine = service.open_sessions.page, service.host.engine
    read = f"Context: {engine.num_tokens:,} of {WINDOW:,} tokens ({100 * engine.num_tokens / WINDOW:.0f}%)"
    assert chat.messages[-1].token_end == engine.num_tokens and context_meter(service).startswith(read)
    assert PageActions(service, tmp_path).refresh_sessions()[-1] == context_meter(service)
    service.page_turns.drop_oldest_turns(words(9, 20))  # the spans are unknown until the next turn
    assert {m.token_end for m in chat.messages} == {-1}
    counted = len(chat_token_ids(engine.tokenizer, conversation("", [(m.role, m.content) for m in chat.messages])))
    assert context_meter(service).startswith(f"Context: {counted:,} of {WINDOW:,} tokens")
    assert PageActions(service, tmp_path).refresh_sessions()[-1] == context_meter(service)


def test_the_api_leaves_its_messages_to_its_client_whatever_the_page_setting(service):
    apply_overflow(service, "drop_oldest")
    turns = []
    for seed in range(4):
        turns += [("user", words(seed)), ("assistant", words(seed + 20, 4))]
    asked = SimpleNamespace(system="", turns=tuple(turns + [("user", words(9))]), documents=())
    with pytest.raises(ApiError) as refused:
        checked_prompt_ids(service, ChatRequest(conversation=asked, stream=False, include_usage=False))
    assert refused.value.status == 400 and "drop the oldest turns" in str(refused.value.message)


def test_a_message_that_does_not_fit_even_by_passages_is_not_told_to_attach_a_smaller_part(service):
    text = "\n\n".join(words(n, 12) for n in range(300))  # paragraphs, some 3,600 tokens: read by passages
    document = Document(name="notes.txt", kind="text", text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                        size_bytes=len(text))
    with pytest.raises(UserError) as refused:
        page_send_files(service, words(3, 60), [document])  # the question alone nearly fills the window
    assert "even with its files read by passages" in str(refused.value) and "smaller part" not in str(refused.value)
    assert service.open_sessions.page.messages == []  # nothing read or sent


def page_send_files(service: ChatService, text: str, documents: list[Document]) -> None:
    for _ in service.page_turns.send(text, documents):
        pass


def test_a_file_repeated_in_a_later_api_turn_is_a_reference_to_the_first_not_read_again(service):
    from chat_service.api_turns import Conversation
    from documents.fitting import READ_ABOVE, READ_ABOVE_TEXT

    text = words(5, 10)
    document = Document(name="notes.txt", kind="text", text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                        size_bytes=len(text))
    asked = Conversation("", (("user", "one"), ("assistant", "red"), ("user", "two")), GREEDY,
                         documents=((document,), (), (document,)), questions=("one", "", "two"))
    read = service.documents.for_api(asked, service.host.engine)
    assert text in read.turns[0][1] and text not in read.turns[2][1] and READ_ABOVE_TEXT in read.turns[2][1]
    assert read.documents[0] == (document,) and read.documents[2][0].read == "notes.txt: whole" + READ_ABOVE


@pytest.mark.parametrize("overflow", ["drop_oldest", "keep_first"])
def test_a_file_attached_again_gets_its_text_back_when_the_turn_that_held_it_is_dropped(service,
                                                                                        model_and_tokenizer,
                                                                                        overflow):
    from documents.fitting import READ_ABOVE_TEXT, is_read_above
    from documents.prompt import attachment_text

    text = words(6, 20)
    document = Document(name="notes.txt", kind="text", text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                        size_bytes=len(text))
    apply_overflow(service, overflow)
    page_send_files(service, words(0, 4), [document])
    page_send(service, words(1, 4))
    page_send_files(service, words(2, 4), [document])  # the same file again: a reference to the first turn's text
    chat = service.open_sessions.page
    first, again = (m for m in chat.messages if m.attachments)
    assert READ_ABOVE_TEXT in again.content and text not in again.content and is_read_above(again.attachments[0])
    users = [m.content for m in chat.messages if m.role == "user"]
    if overflow == "drop_oldest":
        new = words(9, 45)
        # dropping the first turn would fit if the reference stayed one, not with the text back in its place
        assert chat.check_window(new, chat.messages[2:]).fits and not chat.check_window(new).fits
        page_send(service, new)
        (restored,) = (m for m in chat.messages if m.attachments)  # the text went: the reference holds it again
        assert [m.content for m in chat.messages if m.role == "user"] == [restored.content, new]
        assert restored.content == attachment_text(document) + "\n\n" + words(2, 4)
        assert restored.attachments == first.attachments and READ_ABOVE_TEXT not in restored.content
    else:
        new = words(9, 20)
        assert not chat.check_window(new).fits
        page_send(service, new)  # the middle turn goes; the first, and the text, stay: still a reference
        assert [m.content for m in chat.messages if m.role == "user"] == [users[0], users[2], new]
        assert [m.attachments for m in chat.messages if m.attachments] == [first.attachments, again.attachments]
    kept = [(m.role, m.content) for m in chat.messages]
    assert kept[-1][1] == reply_of_fresh_engine(model_and_tokenizer, "", kept[:-1])[0]
