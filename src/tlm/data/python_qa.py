"""`python-qa`: a built-in chat corpus made from the running Python's documentation.

The same sources as `python-stdlib` (what `tlm demo` pretrains on; `python_corpora.py`),
parsed with `ast` and never imported, become questions and answers:

- what a public function or class of a public module does ("What does json.dumps do?"):
  the first paragraph of its docstring, on one line;
- a function's signature ("What is the signature of json.dumps?"): `json.dumps(obj, *, ...)`
  as `ast.unparse` writes its parameters;
- which module provides a name that only one module defines ("Which module provides
  dumps?"): "The json module.";
- what a module is for: the first paragraph of its docstring;
- a language reference topic of `pydoc_data.topics` ("What does the language reference
  say about the "for" statement?"): the first paragraph after its title.

Answers longer than `LONGEST` characters are left out, so that a conversation fits a small
model's context. A function's two questions make one two-turn conversation for a third of
the functions (chosen by a hash of the name) and two one-turn conversations for the rest;
about one conversation in five (by the hash) opens with a system message. The wording of
each question is one of a few, also chosen by the hash. The held-out split is every subject
(a function, class, module or topic) whose hash puts it in the tenth `HELD_OUT`: no
question about a held-out subject is trained on. The corpus is the same on every run of one
installation (another Python version gives another); `docs/chat.md` gives its size.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import sysconfig
from pathlib import Path

from tlm.data.python_corpora import module_paths

LONGEST = 200  # characters of an answer
HELD_OUT = 0  # subjects whose hash is this modulo 10 are held out
SYSTEM = "You answer questions about Python from its documentation."
WHAT = ("What does {} do?", "What is {} for?", "Explain {} briefly.")
SIGNATURE = ("What is the signature of {}?", "How do I call {}?")
WHICH = ("Which module provides {}?", "Where does {} come from?")
MODULE = ("What is the {} module for?", "What does the {} module do?")
TOPIC = ("What does the language reference say about {}?", "Tell me about {}.")

Messages = list[dict[str, str]]


def python_qa() -> tuple[list[tuple[str, Messages]], list[tuple[str, Messages]], str]:
    """(train, held-out, text): the conversations of each split with where each came from
    ("python-qa:N"), and the whole corpus as JSON lines (what its sha256 describes)."""
    train, val = [], []
    for n, (subject, messages) in enumerate(conversations(), start=1):
        (val if _hash(subject) % 10 == HELD_OUT else train).append((f"python-qa:{n}", messages))
    text = "".join(json.dumps({"messages": m}) + "\n" for _, m in [*train, *val])
    return train, val, text


@functools.cache
def conversations() -> tuple[tuple[str, Messages], ...]:
    """Every (subject, messages) of the corpus, in the order of the sources."""
    found, defined = [], {}
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in module_paths(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        if any(part.startswith("_") for part in module.split(".")):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (OSError, SyntaxError, ValueError):  # as python_corpora.module_text
            continue
        answer = first_paragraph(ast.get_docstring(tree))
        if answer:
            found.append((module, [_ask(MODULE, module, module), _say(answer)]))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(module)
                found += _about(module, node)
    for name, modules in defined.items():
        if len(modules) == 1:  # a name two modules define has no one answer
            found.append((name, [_ask(WHICH, name, name), _say(f"The {modules[0]} module.")]))
    found += _topics()
    return tuple((s, _with_system(s, m)) for s, m in found)


def _about(module: str, node: ast.FunctionDef | ast.ClassDef) -> list[tuple[str, Messages]]:
    """The conversations about one function or class of `module`."""
    name = f"{module}.{node.name}"
    answer = first_paragraph(ast.get_docstring(node))
    if not answer:
        return []
    what = [_ask(WHAT, name, name), _say(answer)]
    if not isinstance(node, ast.FunctionDef):
        return [(name, what)]
    signature = f"{name}({ast.unparse(node.args)})"
    if len(signature) > LONGEST:
        return [(name, what)]
    how = [_ask(SIGNATURE, name, name), _say(signature)]
    if _hash(name) % 3 == 0:  # one two-turn conversation
        return [(name, [*what, {"role": "user", "content": "And its signature?"}, how[1]])]
    return [(name, what), (name, how)]


def _topics() -> list[tuple[str, Messages]]:
    """One conversation per language reference topic with a title and a short first
    paragraph."""
    from pydoc_data.topics import topics

    found = []
    for key in sorted(topics):
        lines = topics[key].strip().splitlines()
        if len(lines) < 3 or set(lines[1].strip()) - {"*", "=", "-", "~", "^"}:
            continue  # not a title with its underline
        answer = first_paragraph("\n".join(lines[2:]))
        if answer:
            found.append((key, [_ask(TOPIC, key, lines[0].strip()), _say(answer)]))
    return found


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line; "" when absent or longer than LONGEST."""
    if not doc:
        return ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return paragraph if len(paragraph) <= LONGEST else ""


def _ask(wordings: tuple[str, ...], subject: str, name: str) -> dict[str, str]:
    return {"role": "user", "content": wordings[_hash(subject) % len(wordings)].format(name)}


def _say(answer: str) -> dict[str, str]:
    return {"role": "assistant", "content": answer}


def _with_system(subject: str, messages: Messages) -> Messages:
    if _hash(subject + "/system") % 5:
        return messages
    return [{"role": "system", "content": SYSTEM}, *messages]


def _hash(text: str) -> int:
    """A stable hash (Python's own `hash` of a str changes from run to run)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
