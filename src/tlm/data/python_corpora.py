"""The built-in corpora read from the running Python: `python-docs` and `python-stdlib`.

`python-docs` is the topics of CPython's `pydoc_data.topics` (the language reference that
`help("for")` prints), one document per topic, sorted by name. `python-stdlib` is the
docstrings of the standard library's pure-Python modules, one document per module in sorted
path order, followed by the same topics. The modules' files are parsed with `ast`, never
imported: importing runs a module's code (`antigravity` opens a browser, `this` prints, tkinter
wants a display). The text is the same on every run of one installation; another CPython
version, even another patch release, or a distribution that ships some modules apart (Debian's
tkinter, idlelib, distutils) gives other text.
"""

from __future__ import annotations

import ast
import functools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# tests are code with little prose (Lib/test alone is half of the library's files); __hello__
# and __phello__ exist to test frozen imports
TESTS = frozenset({"test", "tests", "idle_test", "__hello__", "__phello__"})


def python_docs() -> list[str]:
    """The pydoc topics, sorted by name (a blank one, if a version had any, gives no document)."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def python_stdlib() -> list[str]:
    """One document per module of the running Python's standard library, then the topics.

    The topics come last so that the validation split `prepare` cuts from the end holds
    python-docs' own validation text: a model of either corpus can be scored on those bytes."""
    return [*stdlib_documents(sysconfig.get_paths()["stdlib"]), *python_docs()]


@functools.cache  # `prepare` reads its sources twice; parsing ~700 files takes a second or two
def stdlib_documents(root: str) -> tuple[str, ...]:
    """The docstrings of each module under `root` that has any; unreadable files are skipped."""
    texts = (module_text(path) for path in module_paths(Path(root)))
    return tuple(text for text in texts if text)


def module_paths(root: Path) -> list[Path]:
    """The `.py` files under `root` that can be imported as modules, tests left out.

    A folder whose name is not an identifier cannot be a package: this rule leaves out
    site-packages, lib-dynload and config-3.x-*, and, for files, the machine's
    _sysconfigdata_*-linux-gnu.py. Sorted by path, so the order never depends on the disk.
    """
    paths = []
    for folder, subfolders, files in os.walk(root):
        # pruned in place, so that os.walk never lists site-packages' thousands of files
        subfolders[:] = [s for s in subfolders if _is_module(s)]
        stems = (name.removesuffix(".py") for name in files if name.endswith(".py"))
        paths += [Path(folder, f"{stem}.py") for stem in stems if _is_module(stem)]
    return sorted(paths, key=lambda path: path.relative_to(root).as_posix())


def _is_module(name: str) -> bool:
    return name.isidentifier() and name not in TESTS


def module_text(path: Path) -> str:
    """The module's docstrings (its own, then its classes' and functions') in source order,
    cleaned as `help()` shows them; "" for a module with none."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        # unreadable, not this Python's syntax, not in its declared encoding, or NUL bytes
        # (a SyntaxError here; compile() has raised ValueError for them on other versions)
        return ""
    docs = [ast.get_docstring(node) for node in _documented(tree)]
    return "".join(f"{doc}\n\n" for doc in docs if doc).removesuffix("\n")


def _documented(node: ast.AST) -> Iterator[ast.AST]:
    """`node`, then every class and function within it, depth first in source order."""
    yield node
    for child in node.body:
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _documented(child)
