"""The ctypes argument lists of `inference/native/__init__.py: SIGNATURES` against the C sources:
every kernel's parameters and return type as each declaration and definition in the .c files
writes them (a pointer, an int64_t, a float), so that a parameter added, dropped or moved on
one side fails here instead of passing garbage to a kernel."""

import ctypes
import re

import pytest

from tlm.inference.native import HEADERS, SIGNATURES, SOURCES

KINDS = {"pointer": ctypes.c_void_p, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
RETURNS = {"void": None, "int64_t": ctypes.c_int64}


def prototypes(name: str) -> list[tuple[object, list[object]]]:
    """(return type, parameter types) of every declaration and definition of `name` in the
    C sources, as the ctypes types SIGNATURES uses."""
    found = []
    for source in sorted([*SOURCES, *HEADERS]):
        text = re.sub(r"/\*.*?\*/", "", source.read_text(), flags=re.S)
        for match in re.finditer(rf"^(\w+)\s+{name}\s*\(([^)]*)\)", text, re.M):
            params = [p.strip() for p in match.group(2).split(",") if p.strip() not in ("", "void")]
            kinds = [KINDS["pointer" if "*" in p else p.split()[-2]] for p in params]
            found.append((RETURNS[match.group(1)], kinds))
    return found


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_each_kernels_arguments_are_the_c_prototypes(name):
    returns, arguments = SIGNATURES[name]
    written = prototypes(name)
    assert written, f"no C function {name} in {[source.name for source in SOURCES]}"
    for c_returns, c_arguments in written:
        assert c_returns is returns, name
        assert c_arguments == list(arguments), name
