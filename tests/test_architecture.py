"""Imports flow downward through the layers of docs/architecture.md, and nowhere else."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tlm"


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


def is_module(name: str) -> bool:
    """Whether `name` ("tlm.model.transformer") is a module or a package of src/tlm."""
    where = PACKAGE.parent.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def imports(path: Path) -> list[str]:
    """Every tlm module imported by the file at `path`, at any depth (in a function, under
    TYPE_CHECKING): `from tlm.x import y` is tlm.x.y where y is a module, else tlm.x; the
    package's root is "tlm"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tlm" or node.module.startswith("tlm."):
                for alias in node.names:
                    inner = f"{node.module}.{alias.name}"
                    found.append(inner if is_module(inner) else node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "tlm" or a.name.startswith("tlm.")]
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
            if imported == "tlm":  # the root stands above every module
                found.append(f"{importer} imports tlm")
                continue
            if importer.split(".")[1] == imported.split(".")[1]:
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


def import_graph() -> dict[str, set[str]]:
    """Each module of src/tlm -> the tlm modules it imports (`imports`: at any depth)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: set(imports(path)) - {name} for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of imports in `graph`: each set of modules that reach one another
    through their imports (a strongly connected component of two or more; Tarjan 1972)."""
    order: dict[str, int] = {}  # when each module was first reached
    low: dict[str, int] = {}  # the earliest module on the path it reaches back to
    path: list[str] = []
    found = []

    def reach(module: str) -> None:
        order[module] = low[module] = len(order)
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in order:
                reach(imported)
                low[module] = min(low[module], low[imported])
            elif imported in path:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:  # the first of a component: take it off the path
            component = path[path.index(module) :]
            del path[path.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            reach(module)
    return found


def test_no_circle_of_imports():
    """No module imports, at any depth and through any others, a module that imports it:
    a function-level import closes a circle as surely as one at the top of a file."""
    assert circles(import_graph()) == []


def test_a_circle_is_seen():
    """The test above can fail: a circle through three modules and two modules that import
    each other are found; a module that only imports into a circle is in none."""
    graph = {
        "tlm.a": {"tlm.b"},
        "tlm.b": {"tlm.c"},
        "tlm.c": {"tlm.a", "tlm.x"},
        "tlm.d": {"tlm.e"},
        "tlm.e": {"tlm.d"},
        "tlm.f": {"tlm.a"},
    }
    assert circles(graph) == [["tlm.a", "tlm.b", "tlm.c"], ["tlm.d", "tlm.e"]]


def test_imports_are_read_at_any_depth(tmp_path):
    """A function-level import, one under TYPE_CHECKING and a module named from its package
    are each an edge of the graph."""
    source = tmp_path / "reader.py"
    source.write_text(
        "from tlm import upcalls\n"
        "from tlm.config import ModelConfig\n"
        "if TYPE_CHECKING:\n"
        "    from tlm.generate.constrain import Matcher\n"
        "def generate(model):\n"
        "    from tlm.generate.sequences import generate_sequences\n"
    )
    assert sorted(imports(source)) == [
        "tlm.config",
        "tlm.generate.constrain",
        "tlm.generate.sequences",
        "tlm.upcalls",
    ]


# what the math may import besides itself (docs/architecture.md, "model/ is the math only")
MATH_MAY_IMPORT = {"tlm.config", "tlm.errors", "tlm.upcalls"}


def test_the_math_imports_only_itself_config_and_errors():
    """Every module of model/: no inference machinery, no layer above, nothing below but
    the config, the errors and the calls it hands up (`upcalls.py`, provided from above)."""
    found = []
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        for imported in imports(path):
            if not (imported.startswith("tlm.model") or imported in MATH_MAY_IMPORT):
                found.append(f"{module_name(path)} imports {imported}")
    assert found == []


def test_the_math_has_no_switch_for_the_machinery():
    """No thread-local state, no `isinstance` on caches, no method replaced by name."""
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        text = path.read_text()
        for banned in ("threading", "setattr(", "isinstance(cache"):
            assert banned not in text, f"{path.name} has {banned}"


# where a write by a name or into a __dict__ is not a side door: (module, function) -> why
WRITES_ALLOWED = {
    ("tlm.inference.formats.modules", "derived"): "fills the new object it has just made",
    ("tlm.inference.formats.modules", "swapped"): "fills the new object it has just made",
    ("tlm.cli.args", "__call__"): "argparse's Action API: the parsed value on its Namespace",
}


def side_doors(path: Path, module: str) -> list[str]:
    """Writes into an object's `__dict__` (`x.__dict__[k] = v`, `x.__dict__.setdefault(…)`,
    …) and `setattr`/`delattr` calls in `module`'s file at `path`, outside WRITES_ALLOWED."""
    found = []

    def into_dict(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "__dict__"

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        door = None
        if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            if any(isinstance(t, ast.Subscript) and into_dict(t.value) for t in targets):
                door = "writes into a __dict__"
        elif isinstance(node, ast.Call):
            called = node.func
            if isinstance(called, ast.Attribute) and into_dict(called.value):
                if called.attr in ("setdefault", "update", "pop", "clear", "__setitem__"):
                    door = f"calls __dict__.{called.attr}"
            elif isinstance(called, ast.Name) and called.id in ("setattr", "delattr"):
                door = f"calls {called.id}"
        if door and (module, function) not in WRITES_ALLOWED:
            found.append(f"{module}.{function}:{node.lineno} {door}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_no_state_is_left_on_another_object():
    """What a decode prepares lives in its `Decoder` (inference/decoding/decoder.py), not stashed on
    the model or its cache: no module writes into an object's __dict__ or sets attributes
    by name, but where WRITES_ALLOWED says why."""
    paths = sorted(PACKAGE.rglob("*.py"))
    assert [door for path in paths for door in side_doors(path, module_name(path))] == []


def test_a_side_door_is_seen(tmp_path):
    """The test above can fail: each kind of side door in a file is found."""
    source = tmp_path / "doors.py"
    source.write_text(
        "def stash(model, cache):\n"
        "    model.__dict__['_layers'] = 1\n"
        "    cache.__dict__.setdefault('_scratch', 2)\n"
        "    setattr(model, 'route', 3)\n"
    )
    assert side_doors(source, "tlm.doors") == [
        "tlm.doors.stash:2 writes into a __dict__",
        "tlm.doors.stash:3 calls __dict__.setdefault",
        "tlm.doors.stash:4 calls setattr",
    ]
