"""The corpora read from the running Python: `python-docs` and `python-stdlib`."""

import ast
import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from tlm.data import corpus, documents, resolve_sources
from tlm.data import python_corpora as pc

STDLIB = sysconfig.get_paths()["stdlib"]


def read(name: str) -> tuple[list[str], int, str]:
    """The documents of a built-in corpus, with the bytes and sha256 its source reports."""
    [source] = resolve_sources([name])
    docs = list(documents([source]))
    return docs, source.bytes, source.sha256


def test_python_docs_is_the_pydoc_topics_as_before():
    """Tests and benchmarks pin python-docs: the topics sorted by name, blank ones left out."""
    texts = [topics[name] for name in sorted(topics)]
    raw = "".join(texts).encode("utf-8")
    docs, size, sha256 = read("python-docs")
    assert docs == [text for text in texts if text.strip()]
    assert (size, sha256) == (len(raw), hashlib.sha256(raw).hexdigest())


def test_blank_texts_count_in_bytes_and_give_no_document(monkeypatch):
    """No topic is blank on 3.11.7; were one blank, python-docs would still read as before."""
    monkeypatch.setitem(corpus.BUILTIN_PYTHON, "python-docs", lambda: ["one", " \n", "two"])
    raw = b"one \ntwo"
    assert read("python-docs") == (["one", "two"], len(raw), hashlib.sha256(raw).hexdigest())


@pytest.mark.slow
def test_python_stdlib_is_the_modules_then_the_topics():
    docs, size, sha256 = read("python-stdlib")
    modules = pc.stdlib_documents(STDLIB)
    python_docs, _, _ = read("python-docs")
    assert docs == [*modules, *python_docs]  # the topics last: see python_stdlib
    raw = "".join([*modules, *pc.python_docs()]).encode("utf-8")
    assert (size, sha256) == (len(raw), hashlib.sha256(raw).hexdigest())
    assert size > 4 * len("".join(python_docs).encode("utf-8"))  # the reason it exists


def test_stdlib_holds_a_module_docstring_read_from_its_file():
    path = Path(STDLIB, "json", "__init__.py")
    docstring = ast.get_docstring(ast.parse(path.read_bytes()))
    assert docstring.startswith("JSON (JavaScript Object Notation)")
    [text] = [doc for doc in pc.stdlib_documents(STDLIB) if doc.startswith(f"{docstring}\n\n")]
    assert "\n\nSerialize ``obj`` to a JSON formatted ``str``." in text  # json.dumps's


FRESH_READ = """
import json, os, sys, sysconfig
from tlm.data.python_corpora import stdlib_documents
walk = os.walk  # the disk's order of names, reversed: the text must not change

def reversed_walk(root):
    for folder, subfolders, files in walk(root):
        subfolders.reverse()  # what is left after pruning is walked in this order
        yield folder, subfolders, files[::-1]

os.walk = reversed_walk
stdlib = sysconfig.get_paths()["stdlib"]
before = set(sys.modules)
text = "\\0".join(stdlib_documents(stdlib))
new = sorted(set(sys.modules) - before)
assert text
import hashlib
print(json.dumps({"imported": new, "sha256": hashlib.sha256(text.encode()).hexdigest()}))
"""


@pytest.fixture(scope="module")
def fresh_read():
    """The stdlib read once in a new process (no cache to find) whose os.walk gives the
    names in reverse: the modules the read imported, and its text's sha256."""
    run = subprocess.run(
        [sys.executable, "-c", FRESH_READ], capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout)


@pytest.mark.slow
def test_two_reads_are_equal_and_in_sorted_path_order(fresh_read):
    first = pc.stdlib_documents(STDLIB)  # read once per session, then cached
    digest = hashlib.sha256("\0".join(first).encode()).hexdigest()
    assert fresh_read["sha256"] == digest  # read again, in the reverse order of the disk's
    json, json_decoder, xml_dom = (
        pc.module_text(Path(STDLIB, *name.split("/")))
        for name in ("json/__init__.py", "json/decoder.py", "xml/dom/__init__.py")
    )
    assert first.index(json) < first.index(json_decoder) < first.index(xml_dom)


def test_only_importable_modules_are_read_and_tests_are_not(tmp_path):
    files = {
        "json/__init__.py": '"""Json."""',
        "json/tests/test_json.py": '"""A test."""',
        "test/support.py": '"""Test support."""',
        "idlelib/idle_test/htest.py": '"""An IDLE test."""',
        "__phello__/spam.py": '"""Frozen import test."""',
        "site-packages/numpy/core.py": '"""Installed, not the standard library."""',
        "config-3.11-x86_64-linux-gnu/python_config.py": '"""Build files."""',
        "_sysconfigdata__linux_x86_64-linux-gnu.py": '"""This machine\'s build."""',
        "py2.py": 'print "Python 2"\n"""Not this Python\'s syntax."""',
        "binary.py": '"""NUL\0"""',
        "latin1.py": '"""café"""'.encode("latin-1"),  # not UTF-8, and no coding line
        "plain.py": "x = 1  # no docstring: no document",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    paths = [p.relative_to(tmp_path).as_posix() for p in pc.module_paths(tmp_path)]
    assert paths == ["binary.py", "json/__init__.py", "latin1.py", "plain.py", "py2.py"]
    assert pc.stdlib_documents(str(tmp_path)) == ("Json.\n",)
    real = [p.relative_to(STDLIB).parts for p in pc.module_paths(Path(STDLIB))]
    assert ("json", "__init__.py") in real
    assert not [parts for parts in real if pc.TESTS & set(parts) or "site-packages" in parts]


def test_docstrings_come_cleaned_in_source_order(tmp_path):
    (tmp_path / "shapes.py").write_text(
        '"""Shapes."""\n'
        "class Square(Shape):\n"
        '    """A square.\n\n        Four equal sides.\n    """\n'
        "    def area(self):\n"
        '        """Its area."""\n'
        "        def undocumented(): ...\n"
        "async def draw(*shapes):\n"
        '    """Draw them."""\n'
    )
    text = pc.module_text(tmp_path / "shapes.py")
    assert text == "Shapes.\n\nA square.\n\nFour equal sides.\n\nIts area.\n\nDraw them.\n"


@pytest.mark.slow
def test_reading_the_stdlib_imports_none_of_its_modules(fresh_read):
    """Importing runs a module (`antigravity` opens a browser); reading must not import."""
    new = fresh_read["imported"]
    # the only ones: codecs that decode files declaring `# -*- coding: ... -*-`
    assert [name for name in new if not name.startswith("encodings.")] == []
