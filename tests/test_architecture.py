"""Imports flow downward through the layers of docs/architecture.md, and nowhere else."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tlm"
# importer module -> imported layer: the exceptions docs/architecture.md names
ALLOWED_UPWARD = {("tlm.model.transformer", "generate")}


def documented_layers() -> list[set[str]]:
    """The layers of the diagram in docs/architecture.md, top first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    return [
        {name.strip() for name in re.split(r"\s{2,}", line)[0].split("|")}
        for line in block.splitlines()
    ]


def layer_of(module: str, layers: list[set[str]]) -> int:
    top = module.split(".")[1]
    return next(i for i, names in enumerate(layers) if top in names)


def imports(path: Path) -> list[str]:
    """Every tlm module imported by the file at `path`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tlm."):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("tlm.")]
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def violations(layers: list[set[str]]) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        if importer == "tlm":  # the package's public names stand above everything
            continue
        for imported in imports(path):
            mine, theirs = importer.split(".")[1], imported.split(".")[1]
            if mine == theirs or (importer, theirs) in ALLOWED_UPWARD:
                continue
            if layer_of(imported, layers) <= layer_of(importer, layers):  # top is layer 0
                found.append(f"{importer} imports {imported}")
    return found


def test_every_package_is_in_the_documented_layers():
    layers = documented_layers()
    named = set().union(*layers)
    tops = {module_name(p).split(".")[1] for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE}
    tops |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert tops == named


def test_imports_flow_downward_only():
    assert violations(documented_layers()) == []


# what the math may import besides itself (docs/architecture.md, "model/ is the math only")
MATH_MAY_IMPORT = {"tlm.config", "tlm.errors"}


def test_the_math_imports_only_itself_config_and_errors():
    """Every module of model/: no inference machinery, no layer above, nothing below but
    the config and the errors (the one documented exception is `generate`, called lazily)."""
    found = []
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        importer = module_name(path)
        for imported in imports(path):
            own = imported.startswith("tlm.model")
            allowed = (importer, imported.split(".")[1]) in ALLOWED_UPWARD
            if not (own or imported in MATH_MAY_IMPORT or allowed):
                found.append(f"{importer} imports {imported}")
    assert found == []


def test_the_math_has_no_switch_for_the_machinery():
    """No thread-local state, no `isinstance` on caches, no method replaced by name."""
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        text = path.read_text()
        for banned in ("threading", "setattr(", "isinstance(cache"):
            assert banned not in text, f"{path.name} has {banned}"
