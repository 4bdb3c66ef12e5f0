"""Two labeled sets made offline from the running Python's standard library (as
`python-stdlib` is, by `ast`, nothing imported), so that fine-tuning an encoder runs from
nothing (`tlm demo encoder`):

    stdlib-family        each docstring's first paragraph, labeled with its module's family
                         (FAMILIES: gui, net, concurrency, dev, files, numbers, text)
    stdlib-identifiers   the same paragraphs as words, each tagged B-ID where it names
                         something of Python's (a name its module defines or binds: a
                         function, class, method, argument, import; or a standard module),
                         else O

A tenth of the paragraphs is held out, by the hash of where each was read. The sets follow
the installation (another CPython gives other docstrings); their text's sha256 goes into
each run's config as any source's does.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import sysconfig
from pathlib import Path

from tlm.data.python_corpora import _documented, module_paths

FAMILIES = {
    "gui": "tkinter idlelib turtle turtledemo curses",
    "net": "email http urllib mailbox imaplib smtplib nntplib ftplib poplib telnetlib socket "
    "socketserver ssl xmlrpc wsgiref cgi ipaddress selectors",
    "concurrency": "asyncio multiprocessing threading concurrent queue subprocess sched",
    "dev": "unittest doctest pdb bdb inspect ast dis importlib lib2to3 pydoc typing traceback "
    "symtable pickletools imp trace profile cProfile timeit tokenize",
    "files": "tarfile zipfile pathlib shutil tempfile bz2 lzma gzip _pyio os glob fnmatch "
    "filecmp fileinput",
    "numbers": "_pydecimal datetime numbers statistics fractions random calendar",
    "text": "xml re difflib textwrap string html json configparser csv base64 locale optparse "
    "argparse gettext",
}
FAMILY_OF = {module: family for family, names in FAMILIES.items() for module in names.split()}
BUILTIN = ("stdlib-family", "stdlib-identifiers")
MAX_WORDS = 48  # a paragraph's first words: the examples fit the demo's context
PUNCTUATION = "`'\"()[]{},.:;!?*"


def builtin_labeled(name: str) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]], bytes]:
    """(train, held out, text) of built-in set `name`: (where, record) each, and the JSONL
    text the records make (what the source's sha256 describes)."""
    train, val = [], []
    for where, words, family, tags in _paragraphs():
        if name == "stdlib-family":
            record = {"text": " ".join(words), "label": family}
        else:
            record = {"tokens": list(words), "tags": list(tags)}
        (val if _hash(where) % 10 == 0 else train).append((where, record))
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for _, r in train + val)
    return train, val, text.encode()


@functools.cache  # both sets come from one reading of the library's files
def _paragraphs() -> tuple[tuple[str, tuple[str, ...], str, tuple[str, ...]], ...]:
    """(where, the first paragraph's words, the module's family, the words' tags) of every
    documented node of the modules in FAMILIES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in module_paths(root):
        module = path.relative_to(root).parts[0].removesuffix(".py")
        if module not in FAMILY_OF:
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        names = _bound_names(tree)
        for n, node in enumerate(_documented(tree)):
            doc = ast.get_docstring(node)
            words = tuple(doc.split("\n\n")[0].split()[:MAX_WORDS]) if doc else ()
            if len(words) >= 3:
                where = f"{path.relative_to(root).as_posix()}#{n}"
                tags = tuple(_tag(w, names) for w in words)
                found.append((where, words, FAMILY_OF[module], tags))
    return tuple(found)


def _bound_names(tree: ast.AST) -> frozenset[str]:
    """Every name a module defines or binds: functions, classes, arguments, imports (and
    the standard modules of FAMILIES)."""
    names = set(FAMILY_OF)
    for node in ast.walk(tree):  # (a second or two over the library, once)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return frozenset(n for n in names if len(n) > 1 and n not in ("self", "cls"))


def _tag(word: str, names: frozenset[str]) -> str:
    """B-ID for a word that names something of Python's (a dotted name: any of its parts),
    unless it is a plain lowercase word of the prose ("path" in "the path to a file"): such
    a name counts when written as code (`path`, path(), path=, os.path)."""
    core = word.strip(PUNCTUATION)
    parts = [p for p in core.split(".") if p]
    named = bool(parts) and all(p.isidentifier() for p in parts) and any(p in names for p in parts)
    prose = core.isalpha() and core.islower() and word.strip(",.:;!?") == core
    return "B-ID" if named and not prose else "O"


def _hash(where: str) -> int:
    return int.from_bytes(hashlib.sha256(where.encode()).digest()[:8], "big")
