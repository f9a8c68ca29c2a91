"""The package layout is layered: every import points down (docs/architecture.md).

Walks every module of the project with `ast` and checks each project import against the layer
order below: a module may import its own folder and any folder of a lower layer, never one of
the same layer or above, and nothing may form an import cycle. Imports inside functions are
refused too (they hide edges), except those of optional heavy dependencies; imports under
`if TYPE_CHECKING:` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# lowest first; folders on one line are one layer and may not import each other
LAYERS = [
    ["transport", "algos"],  # wire + sockets; pure maths on plain tensors
    ["runtime", "models", "memory", "envs"],  # process runtime; models; weight memory; env API
    ["logic", "engine", "backends"],  # pure role logic; inference engines; training backends
    ["training"],  # the train step and the state it works on
    ["actors"],  # one module per long-lived process: config, handlers, calls into the above
    ["launch"],  # hosts.toml, launcher, supervisor, watch
    ["examples", "scripts", "bench"],  # uses of the system
    ["tests"],
]
RANK = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}
# function-level imports allowed: optional heavy dependencies, imported only when used
# ("*", X) lets any module import X or a module under it; (M, "*") lets M import anything
OPTIONAL_INSIDE_FUNCTIONS = {
    ("*", "backends.megatron"),  # megatron-core is optional: only for backend = "megatron"
    ("bench.transport", "bench.ray_baseline"),  # ray, only for the baseline
    # torch at their tops, needed only by the trainer's process (WeightSyncConfig.build): the
    # launcher, which reads the table, stays light (tests/test_import_cost.py)
    ("engine.weight_sync_config", "engine.weight_push"),
    ("engine.weight_sync_config", "engine.weight_sync"),
    ("memory.config", "memory.manager"),  # the colocated teachers' memory (`build`)
    ("models.tokenizer_load", "models.tokenizer"),  # transformers, when a tokenizer is loaded
}


def allowed_inside(module: str, target: str) -> bool:
    for who, what in OPTIONAL_INSIDE_FUNCTIONS:
        if who in ("*", module) and (what == "*" or target == what
                                     or target.startswith(what + ".")):
            return True
    return False


def modules() -> dict[str, Path]:
    out = {}
    for folder in RANK:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def project_imports(module: str, path: Path, source: str, known: dict[str, Path]):
    """(imported project module, line, inside a function) for each import in `module`."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    in_fn = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if n is not f}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        for name in names:
            target = _resolve(name, known)
            if target and target != module:
                yield target, node.lineno, id(node) in in_fn


def graph(extra: dict[str, str] | None = None) -> tuple[dict[str, set[str]], list[str]]:
    """(import edges, problems) of the project, plus `extra` modules given as {name: source}."""
    known = modules()
    sources = {m: p.read_text() for m, p in known.items()}
    for name, source in (extra or {}).items():
        known[name] = ROOT / (name.replace(".", "/") + ".py")
        sources[name] = source
    edges: dict[str, set[str]] = {m: set() for m in known}
    problems = []
    for module, path in known.items():
        here = module.split(".")[0]
        for target, line, inside in project_imports(module, path, sources[module], known):
            edges[module].add(target)
            there = target.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line}"
            if there != here and RANK[there] >= RANK[here]:
                problems.append(f"{where}: {module} imports {target} ({there}/ is not below "
                                f"{here}/)")
            if inside and here != "tests" and not allowed_inside(module, target):
                problems.append(f"{where}: {module} imports {target} inside a function")
    return edges, problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_every_import_points_down_the_layers():
    _, problems = graph()
    assert problems == []


def test_no_import_cycles():
    edges, _ = graph()
    assert cycles(edges) == []


def test_every_top_level_folder_has_a_layer():
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert folders - set(RANK) == set()


@pytest.mark.parametrize("source, expected", [
    ("from actors.trainer import TrainerConfig\n", "is not below"),
    ("def f():\n    from transport.schema import Sample\n", "inside a function"),
])
def test_the_checker_catches_an_upward_and_a_hidden_import(source, expected):
    """A training module importing an actor, or importing inside a function, is reported."""
    _, problems = graph({"training._layer_probe": source})
    assert any("_layer_probe" in p and expected in p for p in problems)


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
