"""Files and folders written so that nothing is lost.

Atomic writes: write to a temporary name beside the target, fsync, then rename; a crash at
any moment leaves either the old file or the new one, never half of either.

Replacing a folder: tlm replaces only folders it wrote itself (`check_replaceable`); a
folder holding anything else is refused and left untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from fnmatch import fnmatch
from pathlib import Path

from tlm.errors import UserError

TEMPORARY = ("*.tmp-*", "*.old-*")  # what `atomic_path` leaves if a process dies mid-write


class FolderError(UserError):
    """A folder that tlm will not replace; the message says why."""


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path` in one rename.

    A folder already at `path` is renamed aside first and removed only once the new one is
    in place, so a complete folder is always there (or, for an instant, beside it).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _remove(tmp)  # left by a process that died mid-write (with this pid, long ago)
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        if tmp.is_dir() and path.is_dir():
            aside = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, aside)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(aside, path)  # the old folder comes back
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_replaceable(folder: Path, patterns: Iterable[str], signature: str, what: str) -> None:
    """Refuse with `FolderError` unless `folder` is absent, empty, or wholly tlm's: its
    `signature` file is JSON that tlm wrote (it names a "tlm" version) and every file in it
    matches one of `patterns` (paths relative to the folder, as `fnmatch` reads them)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise FolderError(f"{folder} is a file, not a folder; choose another --out")
    files = sorted(_files(folder))
    if not files:
        return
    if not written_by_tlm(folder / signature):
        raise FolderError(
            f"{folder} is not {what} (no {signature} written by tlm); nothing in it was "
            "touched: choose another --out"
        )
    allowed = (*patterns, *TEMPORARY)
    foreign = [name for name in files if not any(fnmatch(name, p) for p in allowed)]
    if foreign:
        raise FolderError(
            f"{folder} holds {foreign[0]}, which tlm did not write; nothing in it was "
            "touched: move it away or choose another --out"
        )


def written_by_tlm(path: Path) -> bool:
    """A JSON file that tlm wrote: an object naming the tlm version that wrote it."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(payload, dict) and "tlm" in payload


def _files(folder: Path) -> Iterator[str]:
    """Every file (and symbolic link) under `folder`, relative, without following links."""
    for root, dirs, names in os.walk(folder):
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        for name in [*names, *links]:
            yield Path(root, name).relative_to(folder).as_posix()
