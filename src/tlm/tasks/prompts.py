"""Question answering and summarising as continuations (§10.7), thin over the decoding API.

The prompt formats (greedy decoding, each prompt starting after <|endoftext|>):

    answer      "Q: {question}\\nA:"  (or "{context}\\n\\nQ: {question}\\nA:"), up to a newline
    summarize   "{text}\\ntl;dr:", up to a newline

A model trained on text that contains such patterns continues them; one that never saw them
continues as best it can. The answer is the continuation with surrounding whitespace removed.
"""

from __future__ import annotations

from tlm.generate import GenerationConfig, complete
from tlm.model import TransformerLM
from tlm.tasks.score import TaskError
from tlm.tokenizer import Tokenizer


def qa_prompt(question: str, context: str | None = None) -> str:
    if not question.strip():
        raise TaskError("the question is empty")
    prompt = f"Q: {question.strip()}\nA:"
    return f"{context.strip()}\n\n{prompt}" if context and context.strip() else prompt


def summary_prompt(text: str) -> str:
    if not text.strip():
        raise TaskError("the text to summarize is empty")
    return f"{text.rstrip()}\ntl;dr:"


def continue_line(
    model: TransformerLM, tokenizer: Tokenizer, prompt: str, max_new_tokens: int
) -> str:
    config = GenerationConfig.of(max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eot_id)
    (completion,) = complete(model, tokenizer, [prompt], config, stop=("\n",))
    return completion.text.strip()


def answer(
    model: TransformerLM,
    tokenizer: Tokenizer,
    question: str,
    context: str | None = None,
    max_new_tokens: int = 48,
) -> str:
    return continue_line(model, tokenizer, qa_prompt(question, context), max_new_tokens)


def summarize(
    model: TransformerLM, tokenizer: Tokenizer, text: str, max_new_tokens: int = 64
) -> str:
    return continue_line(model, tokenizer, summary_prompt(text), max_new_tokens)
