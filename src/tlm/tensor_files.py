"""Weight files read one tensor at a time, each into memory of its own.

`safetensors.torch.load_file` maps the whole file: its tensors are views of one mapping,
and every page a reader touches stays resident until the last tensor from the file is
gone. A loader that converts or packs a model one part at a time wants the opposite, so
that what it has packed and dropped is freed: `TensorFiles` reads a tensor only when it is
asked for, with safetensors' `pread` backend (safetensors >= 0.8; older versions map the
file for that one tensor and copy it out).

A matrix too large to hold whole in fp32 beside the packed model (the token embeddings)
can be left in the file (`TensorFiles.lazy`): read a block of rows at a time, or looked up
row by row (`FileRows`), each lookup reading only its rows. A lookup reads with `pread` at
the offset the file's header gives (the safetensors format: an 8-byte length, a JSON
header, the data), not through a mapping: a mapping would keep every page it touched
resident, and the kernel maps pages around each row it is asked for.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from tlm.errors import UserError


class TensorFileError(UserError):
    """A tensor a weights file names but cannot give."""


DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class TensorFiles(Mapping[str, Tensor]):
    """name -> tensor of a safetensors file, or of the shards of one model, read on access.

    Opening reads only the headers; a file safetensors cannot read raises here.
    """

    def __init__(self, files: list[str | Path]) -> None:
        self._where: dict[str, str] = {}
        for file in map(str, files):
            with safe_open(file, framework="pt") as f:
                self._where |= dict.fromkeys(f.keys(), file)

    def __getitem__(self, name: str) -> Tensor:
        file = self._where[name]
        with _reading(file, name):
            try:
                with safe_open(file, framework="pt", backend="pread") as f:
                    return f.get_tensor(name)
            except TypeError:  # safetensors < 0.8 has no backend: copy out of the mapping
                with safe_open(file, framework="pt") as f:
                    return f.get_tensor(name).clone()

    def lazy(self, name: str) -> LazyMatrix:
        return LazyMatrix(self._where[name], name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


@dataclass(frozen=True)
class LazyMatrix:
    """A [n, d] matrix left in its safetensors file."""

    file: str
    name: str

    @property
    def shape(self) -> tuple[int, int]:
        with safe_open(self.file, framework="pt") as f:
            n, d = f.get_slice(self.name).get_shape()
        return n, d

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, lo: int, hi: int) -> Tensor:
        """Rows lo:hi in fp32, in memory of their own (only their pages are read)."""
        with _reading(self.file, self.name), safe_open(self.file, framework="pt") as f:
            return f.get_slice(self.name)[lo:hi].to(torch.float32, copy=True)


class FileRows:
    """Rows of a [n, d] matrix left in its file, looked up as `F.embedding` would: ids
    [...] -> [..., d] in fp32. The file stays open, so a run that replaces it (tlm writes
    by rename) does not change what this reads."""

    def __init__(self, matrix: LazyMatrix) -> None:
        self.name, self.fd = matrix.file, os.open(matrix.file, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)  # open for as long as the model lives
        size = int.from_bytes(os.pread(self.fd, 8, 0), "little")  # the header, then the data
        entry = json.loads(os.pread(self.fd, size, 8))[matrix.name]
        if entry["dtype"] not in DTYPES or len(entry["shape"]) != 2:
            raise TensorFileError(f"{matrix.name} in {matrix.file} is not a float matrix")
        (self.n, self.d), self.dtype = entry["shape"], DTYPES[entry["dtype"]]
        self.row_bytes = self.d * self.dtype.itemsize
        self.start = 8 + size + entry["data_offsets"][0]

    def __call__(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1).tolist()
        if flat and not 0 <= min(flat) <= max(flat) < self.n:
            raise IndexError(f"token ids must be in [0, {self.n}); got {min(flat)}..{max(flat)}")
        rows = torch.empty(len(flat), self.d, dtype=self.dtype)
        buffer = memoryview(rows.view(torch.uint8).numpy()).cast("B")
        fd, size = self.fd, self.row_bytes
        for i, row in enumerate(flat):
            if os.preadv(fd, [buffer[i * size : (i + 1) * size]], self.start + row * size) < size:
                raise TensorFileError(f"{self.name} is shorter than its header says")
        return rows.float().view(*ids.shape, self.d)


@contextmanager
def _reading(file: str, name: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # the file changed or was cut short since it was opened
        raise TensorFileError(f"cannot read {name} from {file}: {exc}") from None
