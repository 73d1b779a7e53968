"""The package's structure: layers, written once here, no import cycle anywhere in src/, and no function
longer than a screen.

A module may import modules of its own package or of a lower layer, never of a higher one nor of
another package of its own layer. Imports inside functions count; those under `if TYPE_CHECKING:`
(annotations only) count for the layer order but not for cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# bottom to top; a name stands for a module and everything under it
LAYERS: list[list[str]] = [
    ["viasd.errors", "viasd.version", "viasd.datasets"],
    ["viasd.validation"],
    ["viasd.compute"],
    ["viasd.models"],  # computes passes: knows nothing of batching, prefix caching, timing or serving
    ["viasd.execution"],  # how a request's passes run: batch session, prefix cache, pass clock
    ["viasd.decoding", "viasd.routing"],  # the loops; routes and their search
    ["viasd.settings"],  # one declaration per request setting
    ["viasd.api"],  # generate()
    ["viasd"],  # the package's own names (this entry is the package's __init__ alone)
    ["viasd.quality"],
    ["viasd.bench", "viasd.calibrate"],
    ["viasd.report"],
    ["viasd.server"],
    ["viasd.cli"],
    ["viasd.__main__"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported module, only under TYPE_CHECKING) for every import of viasd's own modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.body:
                    visit_one(sub, True)
                for sub in child.orelse:
                    visit_one(sub, typing_only)
            else:
                visit_one(child, typing_only)

    def visit_one(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, typing_only) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # `from pkg import module` imports the module, not the package's __init__
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                if target in modules:
                    found.append((target, typing_only))
        visit(node, typing_only)

    visit(ast.parse(path.read_text()), False)
    return [(t, typing_only) for t, typing_only in found if t != name]


def _layer(name: str) -> tuple[int, str]:
    """(layer index, the entry it falls under): the longest entry that is the module or a package above it."""
    best = None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            covers = name == entry or (name.startswith(entry + ".") and entry != "viasd")
            if covers and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


def _graph() -> dict[str, list[tuple[str, bool]]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_points_down_the_layers():
    wrong = []
    for name, imports in _graph().items():
        layer, entry = _layer(name)
        for target, _ in imports:
            their, their_entry = _layer(target)
            if their > layer or (their == layer and their_entry != entry):
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = {name: sorted({t for t, typing_only in imports if not typing_only}) for name, imports in _graph().items()}
    cycles, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                walk(nxt, path + [node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The two checks above, on a made-up package with both faults: they fail there."""
    pkg = tmp_path / "viasd"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("from viasd.models import b\nfrom viasd.server import app\n")
    (pkg / "models" / "b.py").write_text("def f():\n    from viasd.models.a import x\n")
    (pkg / "server").mkdir()
    (pkg / "server" / "__init__.py").write_text("")
    (pkg / "server" / "app.py").write_text("")
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", tmp_path)
    graph = _graph()
    assert ("viasd.server.app", False) in graph["viasd.models.a"] and ("viasd.models.a", False) in graph["viasd.models.b"]
    with pytest.raises(AssertionError, match="viasd.models.a -> viasd.models.b -> viasd.models.a"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match="viasd.models.a imports viasd.server.app"):
        test_every_import_points_down_the_layers()


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_a_screen():
    """Every function in src/ fits in MAX_FUNCTION_LINES lines (decorators and docstring included)."""
    long = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "functions over the limit:\n" + "\n".join(long)


# ------------------------------------------------------------------ state: no hidden registries or caches

# private attributes of objects no module of src/ defines, which src/ sets on purpose
FOREIGN_PRIVATE = {"_negative_number_matcher"}  # argparse's: settings.py makes "-1=5" a --logit-bias value


def _addresses(node: ast.AST) -> bool:
    """Whether `node` computes an object's address: `x.data_ptr()` or `id(x)`."""
    return any(isinstance(n, ast.Call) and (isinstance(n.func, ast.Attribute) and n.func.attr == "data_ptr"
                                            or isinstance(n.func, ast.Name) and n.func.id == "id") for n in ast.walk(node))


def _targets(node: ast.AST) -> list[ast.AST]:
    return node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []


def _state_problems(source: str) -> list[str]:
    """What in a module's `source` keeps state where its owner does not declare it: a module-level
    mapping keyed by addresses (`x.data_ptr()`, `id(x)`), a write into an object's `__dict__`, a
    `setattr` of a private name on another object, or a private attribute set on an object whose
    class this module does not define (declared in a class body, or set on `self`)."""
    tree = ast.parse(source)
    module_names = {t.id for node in tree.body for t in _targets(node) if isinstance(t, ast.Name)}
    own = {t.id for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for item in c.body for t in _targets(item)
           if isinstance(t, ast.Name)}
    own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Name) and node.value.id in module_names and _addresses(node.slice):
                found.append(f"{line}: module-level {node.value.id} keyed by addresses")
            if isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__" and not isinstance(node.ctx, ast.Load):
                found.append(f"{line}: writes into an object's __dict__")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id in module_names and f.attr in ("get", "setdefault", "pop") \
                    and node.args and _addresses(node.args[0]):
                found.append(f"{line}: module-level {f.value.id} keyed by addresses")
            if (isinstance(f.value, ast.Attribute) and f.value.attr == "__dict__"
                    and f.attr in ("setdefault", "update", "pop", "__setitem__")):
                found.append(f"{line}: writes into an object's __dict__")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and len(node.args) >= 2:
            obj, name = node.args[:2]
            if isinstance(name, ast.Constant) and str(name.value).startswith("_") and not (isinstance(obj, ast.Name) and obj.id == "self"):
                found.append(f"{line}: setattr of private {name.value} on another object")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and node.attr not in own | FOREIGN_PRIVATE \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{line}: sets private {node.attr} of an object another module defines")
    return found


def test_no_state_hides_outside_its_owner():
    """No module of src/ keeps a registry keyed by object addresses (what a pass knows of its logits
    travels with them: `models.logits.PassOutput`), and no cache lives in an object's `__dict__` or in
    private attributes set from another module: each is a declared field of the object owning it."""
    found = [f"{path.relative_to(SRC)}:{p}" for path in sorted(SRC.rglob("*.py")) for p in _state_problems(path.read_text())]
    assert not found, "state outside its owner:\n" + "\n".join(found)


def test_the_state_check_sees_each_kind():
    source = '''
import weakref
_known = {}
def remember(x, v):
    _known[x.untyped_storage().data_ptr()] = v
def known(x):
    return _known.get(id(x))
def stash(model, t):
    model.__dict__["_tokenizer"] = t
    model.__dict__.setdefault("_bridges", {})
    setattr(model, "_cache", {})
    model._times = {}
class Own:
    _heads: dict
    def __init__(self):
        self._heads = {}
def fine(other: Own):
    other._heads = {}
'''
    assert [p.split(": ", 1)[1] for p in _state_problems(source)] == [
        "module-level _known keyed by addresses", "module-level _known keyed by addresses", "writes into an object's __dict__",
        "writes into an object's __dict__", "setattr of private _cache on another object",
        "sets private _times of an object another module defines"]


_CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def _duration_asserts(source: str) -> list[int]:
    """Lines of `assert`s on a clock reading minus another (a duration, which flakes on a busy machine;
    a bounded wait's give-up deadline, `monotonic() < deadline`, is no duration)."""
    def reads_clock(x):
        return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in _CLOCKS for c in ast.walk(x))

    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assert)
                   for sub in ast.walk(node.test) if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub)
                   and reads_clock(sub)})


def test_no_test_asserts_a_duration():
    """What a time limit would guard is checked another way (a process that must be killed is checked
    as killed, not as fast)."""
    tests = Path(__file__).parent
    found = [f"{p.relative_to(tests)}:{n}" for p in sorted(tests.rglob("*.py")) for n in _duration_asserts(p.read_text())]
    assert not found, "tests asserting durations:\n" + "\n".join(found)
    assert _duration_asserts("import time\nt = time.monotonic()\nassert time.monotonic() - t < 4\n"
                             "assert time.monotonic() < t + 60, 'gave up'\n") == [3]
