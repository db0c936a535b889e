"""A reply stops at its family's end of turn, whichever of the model's three sources names it.

Each family gets a tokenizer built here (no hub) that carries its real special-token strings and a chat
template that writes its turn format, and a tiny Llama whose every step emits one chosen token: the end of
turn must finish the reply at once ("eos"), any other special token of the family must not.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from infinigen_core.config import EngineConfig, SamplingConfig
from infinigen_core.engine import InfiniGenEngine
from infinigen_core.generation import chat_token_ids, chat_token_ids_many, end_token_ids, generate

WORDS = ["Hi", "there", "the", "capital", "is", "Paris", "user", "assistant", "model", "system"]


@dataclass(frozen=True)
class FamilyTokens:
    specials: tuple[str, ...]  # the family's special tokens, the tokenizer's eos among them
    eos: str  # what the tokenizer calls its eos
    template: str  # how the family writes a conversation
    turn_end: str  # the token a reply must stop at
    not_an_end: str  # a special token that must not end a reply
    generation_eos: tuple[str, ...] = ()  # generation_config.eos_token_id, where the family sets a list


# Qwen and SmolLM write their turns the same way (ChatML); they differ in which token the tokenizer calls eos
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

FAMILIES = {
    # Llama 3.x: the generation config lists <|eom_id|> (a tool-call turn's end) beside the other two
    "llama3": FamilyTokens(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>"), "<|end_of_text|>",
        "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
        "\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
        "<|eom_id|>", "<|start_header_id|>", ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "qwen": FamilyTokens(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|endoftext|>",
        CHATML,
        "<|im_end|>", "<|im_start|>"),
    "phi": FamilyTokens(
        ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), "<|endoftext|>",
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
        "<|end|>", "<|assistant|>"),
    "gemma3": FamilyTokens(
        ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), "<eos>",
        "{{ '<bos>' }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
        "<end_of_turn>", "<start_of_turn>"),
    "smollm": FamilyTokens(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>",
        CHATML,
        "<|im_end|>", "<|im_start|>"),
    "mistral": FamilyTokens(
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "</s>",
        "{{ '<s>' }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ m['content'] + '</s>' }}{% endif %}{% endfor %}",
        "</s>", "[INST]"),
}


def family_tokenizer(family: FamilyTokens) -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(family.specials + ("[UNK]",) + tuple(WORDS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=family.eos, unk_token="[UNK]",
                                        chat_template=family.template)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in family.specials if t != family.eos]})
    return tokenizer


def emitting_model(vocab_size: int, token_id: int, eos_ids: list[int] | None) -> LlamaForCausalLM:
    """A tiny Llama whose next token is always `token_id`: every position's hidden state is the same
    all-ones vector (constant embeddings, attention and MLP outputs zeroed) and only that token's head row
    reads it."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=eos_ids, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id] = 1.0
    return model


def reply(family: FamilyTokens, emitted: str) -> list:
    tokenizer = family_tokenizer(family)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos] or None
    model = emitting_model(len(tokenizer), tokenizer.convert_tokens_to_ids(emitted), eos_ids)
    engine = InfiniGenEngine(model, tokenizer, EngineConfig(policy="full"))
    prompt = chat_token_ids(tokenizer, [{"role": "user", "content": "Hi the capital is"}])
    return list(generate(engine, prompt, SamplingConfig(max_new_tokens=4)))


@pytest.mark.parametrize(("name", "emits_turn_end"), [(name, end) for name in sorted(FAMILIES) for end in (True, False)])
def test_a_reply_stops_at_its_familys_end_of_turn_and_at_no_other_special_token(name, emits_turn_end):
    family = FAMILIES[name]
    events = reply(family, family.turn_end if emits_turn_end else family.not_an_end)
    if emits_turn_end:
        assert events[-1].finish_reason == "eos" and events[-1].full_text == ""
        assert [e.token_id for e in events] == [None]  # the end token itself is never shown
    else:
        assert events[-1].finish_reason == "length" and len([e for e in events if e.token_id is not None]) == 4


def test_each_source_is_read():
    """The generation config's list, the tokenizer's eos and the template's turn marker each add their own."""
    llama3 = family_tokenizer(FAMILIES["llama3"])
    ids = {token: llama3.convert_tokens_to_ids(token) for token in FAMILIES["llama3"].specials}
    config = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                          num_attention_heads=1, eos_token_id=[ids["<|eom_id|>"]])).generation_config
    assert end_token_ids(llama3) == {ids["<|end_of_text|>"], ids["<|eot_id|>"]}
    assert end_token_ids(llama3, config) == {ids["<|end_of_text|>"], ids["<|eot_id|>"], ids["<|eom_id|>"]}
    assert end_token_ids(None, config) == {ids["<|eom_id|>"]}
    phi = family_tokenizer(FAMILIES["phi"])
    phi.chat_template = None  # without a template only the eos is known
    assert end_token_ids(phi) == {phi.convert_tokens_to_ids("<|endoftext|>")}


def test_a_model_without_a_chat_template_reads_the_conversation_as_a_plain_transcript():
    """A base model (Gemma 3 270M's GGUF has no template) still chats: the turns as labelled paragraphs, the
    reply prompted by "Assistant:" (apply_chat_template itself raises on such a tokenizer)."""
    tokenizer = family_tokenizer(FAMILIES["gemma3"])
    tokenizer.chat_template = None
    messages = [{"role": "user", "content": "Hi the capital"}, {"role": "assistant", "content": "is Paris"},
                {"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError):
        tokenizer.apply_chat_template(messages, tokenize=True)
    ids = chat_token_ids(tokenizer, messages)
    # the role labels are no words of this vocabulary: each reads as [UNK] before its turn's words
    assert tokenizer.decode(ids) == "[UNK] Hi the capital [UNK] is Paris [UNK] Hi [UNK]"
    closed = chat_token_ids(tokenizer, messages, add_generation_prompt=False)
    assert ids[: len(closed)] == closed and len(ids) == len(closed) + 1


@pytest.mark.parametrize("templated", [False, True])
def test_several_conversations_tokenize_as_each_alone_a_plain_transcript_in_one_call(templated, monkeypatch):
    """`chat_token_ids_many` gives each (messages, generation prompt) the ids `chat_token_ids` gives it; without a
    template the texts go to the tokenizer in one batched call (a turn's window check and its message start)."""
    tokenizer = family_tokenizer(FAMILIES["gemma3"])
    if not templated:
        tokenizer.chat_template = None
    first = [{"role": "user", "content": "Hi the capital"}, {"role": "assistant", "content": "is Paris"}]
    asked = [(first + [{"role": "user", "content": "Hi"}], True), (first, False), (first[:1], True)]
    alone = [chat_token_ids(tokenizer, messages, prompt) for messages, prompt in asked]
    calls = []
    encode = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, *a, **k: (calls.append(text),
                                                                                   encode(self, text, *a, **k))[1])
    assert chat_token_ids_many(tokenizer, asked) == alone
    assert len(calls) == (3 if templated else 1) and (templated or len(calls[0]) == 3)


def chain_model(vocab_size: int, successor: dict[int, int]) -> LlamaForCausalLM:
    """A tiny Llama whose next token is `successor[last token]`: each token's embedding is its own one-hot
    vector, carried unchanged to the head (attention and MLP outputs zeroed), and the head row of each
    successor reads its predecessor's."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    assert vocab_size <= config.hidden_size
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.eye(vocab_size, config.hidden_size))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for token_id, following in successor.items():
            model.lm_head.weight[following, token_id] = 1.0
    return model


def test_a_reply_without_a_chat_template_stops_before_the_next_turns_label():
    """A base model continues the transcript past its reply: the new line that opens the next "User:" turn
    ends the reply there, the label (written over several tokens) never shown, not even its first half."""
    family = FAMILIES["gemma3"]
    words = ["Hi", "the", "capital", "Paris", "is", "\n", "User", ":"]
    vocab = {token: index for index, token in enumerate(family.specials + ("[UNK]",) + tuple(words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.Fuse()  # the tokens' text joined as it is, as a byte-level tokenizer decodes
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=family.eos, unk_token="[UNK]")
    assert not tokenizer.chat_template
    # after the prompt's "Assistant:" ([UNK]) the model writes "Paris", then "\nUser:" and the user's turn
    chain = ["[UNK]", "Paris", "\n", "User", ":", "Hi", "the", "capital", "is"]
    successor = {vocab[a]: vocab[b] for a, b in zip(chain, chain[1:])}
    engine = InfiniGenEngine(chain_model(len(vocab), successor), tokenizer, EngineConfig(policy="full"))
    prompt = chat_token_ids(tokenizer, [{"role": "user", "content": "Hi the capital is"}])
    events = list(generate(engine, prompt, SamplingConfig(max_new_tokens=12)))
    assert events[-1].finish_reason == "stop" and events[-1].full_text == "Paris"
    assert [e.token_id for e in events if e.token_id is not None] == [vocab[t] for t in chain[1:5]]
    assert "".join(e.text for e in events) == "Paris" and all("\n" not in e.full_text for e in events)
    # with a chat template the reply is no transcript and the label no stop: the same model writes the next turn
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine.reset()
    events = list(generate(engine, prompt, SamplingConfig(max_new_tokens=12)))
    assert events[-1].finish_reason == "length" and "\nUser:Hi" in events[-1].full_text
