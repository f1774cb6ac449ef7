"""No import cycles between relax_hpc's subpackages.

Every module under ``relax_hpc`` is parsed with ``ast``; every executed import counts, module-level or
function-local (a lazy import only hides a cycle, it does not remove it), relative ones resolved. Imports under
``if TYPE_CHECKING:`` do not: they never run, and naming a config dataclass in an annotation (the rollout code
annotating ``Recipe``, which the recipe validator's checks import back) is not a dependency of the code. A node is the first component
under ``relax_hpc`` (``controller``, ``launch``, ...; a top-level module such as ``rundir.py`` is its own node, and
``relax_hpc/__init__.py`` is ``relax_hpc``). The test fails on any cycle in that graph and prints the edges, with
file:line, that form it.

The same check runs a level down, with modules as nodes (:func:`module_graph`): no cycle among the modules of one
subpackage either, imports inside functions and under ``TYPE_CHECKING`` counted (within a subpackage a type-only
import back is still a knot: the two modules are one unit that was split). An import names the deepest module it
reaches (``from relax_hpc.x import y`` is ``relax_hpc.x.y`` when y is a module, else ``relax_hpc.x``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import relax_hpc

PKG = "relax_hpc"
ROOT = Path(relax_hpc.__file__).resolve().parent


def _module_name(path: Path) -> tuple[str, bool]:
    """Dotted name of a file under ROOT, and whether it is a package ``__init__``."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _node(dotted: str) -> str | None:
    """The graph node of a dotted module name, or None when it is not ours."""
    parts = dotted.split(".")
    if parts[0] != PKG:
        return None
    return parts[1] if len(parts) > 1 else PKG


def _imported(tree: ast.AST, module: str, is_pkg: bool, *, type_checking: bool = False) -> list[tuple[str, int]]:
    """(absolute dotted target, line) for every import in a module, nested ones included (and those under
    ``if TYPE_CHECKING:`` with ``type_checking``)."""
    package = module if is_pkg else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in (ast.walk(tree) if type_checking else _executed(tree)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # ``from X import y`` may name a submodule y: count X.y. Its node is X's, except for
            # ``from relax_hpc import y``, whose node is y (``__version__`` would be a node of its own: harmless).
            for alias in node.names:
                out.append((f"{prefix}.{alias.name}" if alias.name != "*" else prefix, node.lineno))
    return out


def _executed(tree: ast.AST):
    """ast.walk, without the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs, and is walked)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(from node, to node) -> the places ("path:line  import target") that make the edge."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        module, is_pkg = _module_name(path)
        src = _node(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, line in _imported(tree, module, is_pkg):
            dst = _node(target)
            if dst is None or dst == src:
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line}  {target}"
            edges[(src, dst)].append(where)
    return edges


def find_cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def report(edges, sccs) -> str:
    lines = []
    for comp in sccs:
        lines.append(f"import cycle among: {', '.join(comp)}")
        members = set(comp)
        for (a, b), places in sorted(edges.items()):
            if a in members and b in members:
                lines.append(f"  {a} -> {b}")
                lines.extend(f"      {p}" for p in places)
    return "\n".join(lines)


def test_graph_sees_lazy_and_relative_imports():
    """The parser resolves relative imports and counts function-local ones."""
    src = "from . import a\nfrom ..b import c\ndef f():\n    from relax_hpc.d import e\n    import relax_hpc.f.g\n"
    got = {t for t, _ in _imported(ast.parse(src), "relax_hpc.x.y", False)}
    assert got == {"relax_hpc.x.a", "relax_hpc.b.c", "relax_hpc.d.e", "relax_hpc.f.g"}
    got = {t for t, _ in _imported(ast.parse("from . import a\n"), "relax_hpc.x", True)}
    assert got == {"relax_hpc.x.a"}
    src = "if TYPE_CHECKING:\n    from relax_hpc.r import R\nelse:\n    import relax_hpc.s\nif typing.TYPE_CHECKING:\n    import relax_hpc.t\n"
    assert {t for t, _ in _imported(ast.parse(src), "relax_hpc.x.y", False)} == {"relax_hpc.s"}  # annotations only


def test_no_cycle_detected_in_a_chain_and_one_in_a_loop():
    assert find_cycles({("a", "b"): [], ("b", "c"): []}) == []
    assert find_cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): []}) == [["a", "b", "c"]]


def module_graph() -> dict[tuple[str, str], list[str]]:
    """(from module, to module) -> the places that make the edge, for imports within one subpackage."""
    paths = {_module_name(p)[0]: p for p in ROOT.rglob("*.py")}
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in sorted(paths.items()):
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, line in _imported(tree, module, is_pkg, type_checking=True):
            while target and target not in paths:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if not target or target == module or _node(target) != _node(module) or _node(module) == PKG:
                continue
            edges[(module, target)].append(f"{path.relative_to(ROOT.parent)}:{line}  {target}")
    return edges


def test_no_import_cycles_between_subpackages():
    edges = import_graph()
    assert edges, "no imports found: is the package root right?"
    sccs = find_cycles(edges)
    assert not sccs, "\n" + report(edges, sccs)


def test_no_import_cycles_between_modules_of_a_subpackage():
    edges = module_graph()
    assert ("relax_hpc.rollout.driver", "relax_hpc.rollout.sample") in edges, "the module graph lost its edges"
    sccs = find_cycles(edges)
    assert not sccs, "\n" + report(edges, sccs)


def documented_arrows() -> dict[str, set[str]]:
    """docs/architecture.md's ```arrows block: ``a -> b c`` per line."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = text.split("```arrows\n", 1)[1].split("```", 1)[0]
    out: dict[str, set[str]] = {}
    for line in block.splitlines():
        if line.strip():
            src, _, dsts = line.partition("->")
            out[src.strip()] = set(dsts.split())
    return out


def test_the_arrows_between_packages_are_those_docs_architecture_md_draws():
    """A new arrow between packages is a design decision: it fails here until docs/architecture.md draws it (and
    one the code dropped fails until the drawing does too)."""
    actual: dict[str, set[str]] = defaultdict(set)
    for src, dst in import_graph():
        actual[src].add(dst)
    drawn = documented_arrows()
    new = sorted(f"{a} -> {b}" for a in actual for b in actual[a] - drawn.get(a, set()))
    gone = sorted(f"{a} -> {b}" for a in drawn for b in drawn[a] - actual.get(a, set()))
    assert not new, f"arrows the code has and docs/architecture.md does not draw: {new}"
    assert not gone, f"arrows docs/architecture.md draws and the code no longer has: {gone}"
