"""Which reading budget lets a model answer from a document far longer than its window.

    python -m bench reading [--tokens 40000] [--configs 32:80,48:112,64:160,100:250,200:500,200:1000]

A document of about `--tokens` tokens (bench/data/cat_and_racket.txt repeated, in paragraphs) gets one
planted fact at 70% of its length; for each (passage tokens : budget tokens) the passages are chosen for a
question about that fact (documents/reading.py), put in the user message as the app puts a document, and
the default model answers greedily (16 tokens, plain transformers). Per configuration: how often the
planted passage was among those read, and how often the answer names the fact, over five facts.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

FACTS = (  # (sentence planted, question, the word the answer must contain)
    ("The harbour master's cat is named Biscuit.", "What is the harbour master's cat named?", "biscuit"),
    ("The lighthouse keeper painted his boat green.", "What colour did the lighthouse keeper paint his boat?",
     "green"),
    ("The baker's secret ingredient is cardamom.", "What is the baker's secret ingredient?", "cardamom"),
    ("The mayor's horse is called Thunder.", "What is the mayor's horse called?", "thunder"),
    ("The old stone bridge was built in 1742.", "In which year was the old stone bridge built?", "1742"),
)
DATA = Path(__file__).resolve().parent / "data" / "cat_and_racket.txt"
DEFAULT_CONFIGS = "32:80,48:112,64:160,100:250,200:500,200:1000"


def parse_configs(text: str):
    from documents.reading import ReadingConfig

    configs = []
    for item in text.split(","):
        passage, budget = (int(part) for part in item.split(":"))
        configs.append(ReadingConfig(passage_tokens=passage, budget_tokens=budget))
    return configs


def planted_document(tokens: int, fact: str):
    """About `tokens` tokens (4 characters each) of the story in paragraphs, `fact` alone at 70% of it."""
    from documents import Document

    story = DATA.read_text(encoding="utf-8").split("\n", 2)[2]  # without the source line
    paragraphs = [p for p in story.split("\n\n") if p.strip()]
    body, size = [], 0
    while size < tokens * 4:
        for paragraph in paragraphs:
            body.append(paragraph)
            size += len(paragraph) + 2
    body.insert(int(len(body) * 0.7), fact)
    text = "\n\n".join(body)
    return Document(name="story.txt", kind="text", text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                    size_bytes=len(text.encode()))


def _answer(model, tokenizer, message: str) -> tuple[str, int]:
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), ids.shape[1]


def measure(tokens: int = 40_000, configs_text: str = DEFAULT_CONFIGS, show=lambda line: None) -> list[dict]:
    import torch

    from documents import message_with_attachments
    from documents.passage_index import PassageIndex
    from documents.reading import read_for_question
    from infinigen_core.loading import default_cache_dir, load_model

    model, tokenizer, _ = load_model(None, default_cache_dir(), torch.device("cpu"), progress=show)
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rows = []
    with tempfile.TemporaryDirectory(prefix="reading-bench-") as folder:
        for config in parse_configs(configs_text):
            found = answered = prompt_tokens = 0
            for fact, question, expected in FACTS:
                document = planted_document(tokens, fact)
                index = PassageIndex.open(folder, document, config.passage_tokens)
                reading = read_for_question(index, document, question, config, count)
                index.close()
                reply, prompt = _answer(model, tokenizer, message_with_attachments(question, [reading.document]))
                found += fact in reading.document.text
                answered += expected in reply.lower()
                prompt_tokens += prompt
                show(f"{config.passage_tokens}:{config.budget_tokens} {reading.description} -> {reply.strip()!r}")
            rows.append({"passage_tokens": config.passage_tokens, "budget_tokens": config.budget_tokens,
                         "fact_read": f"{found}/{len(FACTS)}", "answered": f"{answered}/{len(FACTS)}",
                         "mean_prompt_tokens": prompt_tokens / len(FACTS)})
    return rows
