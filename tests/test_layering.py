"""How the code is layered: training does not import the tools that run after it, the package's
modules import each other without cycles, and no test module imports another."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tapered_megatron"


def _modules_loaded_by(statement: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running ``statement``."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_training_imports_neither_eval_nor_export() -> None:
    loaded = _modules_loaded_by("import tapered_megatron.training.trainer")
    assert "tapered_megatron.training.trainer" in loaded  # the check itself sees the import
    bad = [
        m
        for m in loaded
        if m.startswith("tapered_megatron.") and m.split(".")[1] in ("eval", "export", "hf")
    ]
    assert not bad, f"importing the trainer imports {bad}"


def test_configuration_is_a_leaf() -> None:
    """Loading and validating every preset imports neither torch nor the model or data code."""
    loaded = _modules_loaded_by(
        "from tapered_megatron.config import load_config, preset_names, validate; "
        "[validate(load_config(p)) for p in preset_names()]"
    )
    assert "tapered_megatron.architectures.titans" in loaded  # the presets' records were read
    heavy = ("tapered_megatron.models", "tapered_megatron.data")
    bad = [m for m in loaded if m.split(".")[0] == "torch" or m.startswith(heavy)]
    assert not bad, f"loading a config imports {bad[:8]}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level and deferred inside functions and
    classes (a deferred import still makes the two modules depend on each other); not those
    under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                for other in child.orelse:
                    visit_stmt(other)
                continue
            visit_stmt(child)

    def visit_stmt(child: ast.AST) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        else:
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules that importing it imports (relative imports resolved;
    ``import a.b.c`` also imports the packages ``a`` and ``a.b``, except those the importing
    module sits in, which are initialised before it)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in paths]
            targets.update(subs)
            if len(subs) < len(node.names):  # names from the module itself
                targets.add(base)
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges = set()
        for t in targets:
            parts = t.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {t for t in edges if t in paths and t not in own and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_resolves_imports_like_python() -> None:
    graph = import_graph()
    # relative and absolute imports, the package a module is imported through, not its own
    assert "tapered_megatron.config" in graph["tapered_megatron.models.summary"]
    assert "tapered_megatron.export" in graph["tapered_megatron.eval.common"]
    assert "tapered_megatron.models" not in graph["tapered_megatron.models.language_model"]
    # deferred imports count; TYPE_CHECKING ones do not
    assert "tapered_megatron.data" in graph["tapered_megatron.eval.common"]
    assert "tapered_megatron.config" not in graph["tapered_megatron.models.language_model"]


def test_no_import_cycles_in_the_package() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_test_module_imports_another() -> None:
    tests = {p.stem for p in Path(__file__).parent.glob("test_*.py")}
    bad = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            bad += [f"{path.name} imports {n}" for n in names if n and n.split(".")[0] in tests]
    assert not bad, "; ".join(bad) + " (share fixtures in conftest.py, helpers in a module)"


def _package(path: Path) -> str:
    """The package a file belongs to: its folder, dotted (``tapered_megatron.training``)."""
    return ".".join(path.relative_to(ROOT).parts[:-1])


def _module_package(module: str) -> str:
    """The package of an imported module name: itself when it is a package, else its parent."""
    if (ROOT / module.replace(".", "/") / "__init__.py").exists():
        return module
    return module.rpartition(".")[0]


def test_no_module_uses_another_packages_private_names() -> None:
    """An underscore name is private to its package: the package, its tools (scripts, pretrain,
    data_tools) and the experiments reach other packages through public names only. An
    attribute ``x._name`` counts when ``_name`` is defined (def, class or assignment) only in
    other packages; ``self._name`` and ``cls._name`` are the object's own."""
    folders = ("tapered_megatron", "scripts", "pretrain", "data_tools", "experiments")
    files = [p for d in folders for p in (ROOT / d).rglob("*.py")]
    trees = {p: ast.parse(p.read_text()) for p in files}
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    defined: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [
                    t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in targets
                ]
            for name in filter(private, names):
                defined.setdefault(name, set()).add(_package(path))
    bad = []
    for path, tree in trees.items():
        mine = _package(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "tapered_megatron"
            ):
                if _module_package(node.module) != mine:
                    bad += [
                        f"{path.name}:{node.lineno} {a.name}" for a in node.names if private(a.name)
                    ]
            elif isinstance(node, ast.Attribute) and private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                owners = defined.get(node.attr, set())
                if owners and mine not in owners:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not bad, f"private names used across packages: {bad}"
