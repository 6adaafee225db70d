"""The shape of the code: no import circle, the solvers' layers, small folders, a docstring line per module.

The graph is read from the source (``ast``), not by importing: an import inside a function counts
as much as one at the top of a module (it is a circle all the same, only deferred to run time);
imports under ``if TYPE_CHECKING:`` do not (they never run). Edges go to the module named: ``from
.x import y`` is an edge to ``x``, or to ``x.y`` when that is a module; a package's ``__init__``
is a node like any other. See ARCHITECTURE.md for the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
# import name -> folder (solvers/ installs as remat_pass.solvers: pyproject's package-dir)
PACKAGES = {"remat_pass": ROOT / "remat_pass", "remat_pass.solvers": ROOT / "solvers"}
MAX_MODULES_PER_FOLDER = 15

# The solvers' layers, bottom first: a module imports its own layer and those below it, never above.
SOLVER_LAYERS = (
    ("records", ("problem", "status", "tags", "errors", "module_account", "clock")),
    ("analyses", ("analysis",)),
    ("integer program", ("mip",)),
    ("registry", ("registry", "baselines")),
    ("planners", ("ilp", "offload_planner", "fast", "peak")),
    ("face", ("",)),
)


def modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """Every module by its import name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level or in a function, not for type checkers."""
    found = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            stack += node.orelse
            continue
        stack += ast.iter_child_nodes(node)
    return found


def import_graph(packages: dict[str, Path] = PACKAGES) -> nx.DiGraph:
    """Module -> the project modules it imports."""
    known = modules(packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                           for alias in node.names]
            graph.add_edges_from((name, target) for target in targets if target in known and target != name)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """One circle through each strongly connected group of modules, as the chain of imports."""
    found = []
    for group in nx.strongly_connected_components(graph):
        if len(group) > 1:
            found.append([edge[0] for edge in nx.find_cycle(graph.subgraph(group))])
    return sorted(found)


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles (each module imports the next, the last the first):\n" + "\n".join(
        " -> ".join(chain + chain[:1]) for chain in found)


def test_a_circle_is_caught(tmp_path):
    """The check itself: two modules that import each other, one of them only inside a function."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "sub" / "__init__.py").write_text('"""A sub-package."""\n')
    (package / "a.py").write_text('"""A."""\nfrom .sub.b import f\n')
    (package / "sub" / "b.py").write_text('"""B."""\n\n\ndef f():\n    from .. import a\n    return a\n')
    (package / "c.py").write_text('"""C."""\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n'
                                  '    from . import a\n')
    graph = import_graph({"pkg": package})
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]] or cycles(graph) == [["pkg.sub.b", "pkg.a"]]
    assert not graph.has_edge("pkg.c", "pkg.a")  # a type checker's import never runs


def _solver_layer(name: str) -> int:
    rest = name.removeprefix("remat_pass.solvers").lstrip(".")
    head = rest.split(".")[0]
    for index, (_, heads) in enumerate(SOLVER_LAYERS):
        if head in heads:
            return index
    raise AssertionError(f"{name} is in none of SOLVER_LAYERS: put it in one (tests/test_import_graph.py)")


def test_solvers_import_downward_only():
    """Records at the bottom import none of the analyses or planners; analyses none of the planners."""
    graph = import_graph()
    wrong = []
    for source, target in graph.edges:
        if source.startswith("remat_pass.solvers") and _solver_layer(target) > _solver_layer(source):
            wrong.append(f"{source} ({SOLVER_LAYERS[_solver_layer(source)][0]}) imports {target} "
                         f"({SOLVER_LAYERS[_solver_layer(target)][0]})")
    assert not wrong, "\n".join(wrong)


def test_solvers_import_no_torch_side_module():
    graph = import_graph()
    wrong = [f"{s} -> {t}" for s, t in graph.edges
             if s.startswith("remat_pass.solvers") and not t.startswith("remat_pass.solvers")]
    assert not wrong


def test_no_folder_holds_more_than_fifteen_modules():
    crowded = {}
    for folder in PACKAGES.values():
        for directory in [folder, *(p for p in folder.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            count = len([p for p in directory.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES_PER_FOLDER:
                crowded[directory.relative_to(ROOT).as_posix()] = count
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules (make a package by stage): {crowded}"


def test_every_module_opens_with_its_one_idea():
    """The file's first line is the docstring's summary line: a newcomer reads one line per module."""
    missing = []
    for name, path in modules().items():
        text = path.read_text()
        first = text.splitlines()[0] if text else ""
        summary = first.removeprefix('"""').strip()
        if not first.startswith('"""') or not summary or not ast.get_docstring(ast.parse(text)):
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"modules whose first line is not a docstring's summary: {missing}"


def test_no_package_or_module_shadows_a_public_name():
    """``import remat_pass.<x>`` binds ``remat_pass.<x>`` to the module: no ``plan/`` beside ``remat_pass.plan``."""
    import remat_pass

    children = {p.stem for p in (ROOT / "remat_pass").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert not children & set(remat_pass.__all__)


def test_plan_accounts_are_registered_by_the_analyses():
    """The records import no analysis; importing any solvers module (the package first) registers both."""
    import subprocess
    import sys

    code = ("import remat_pass.solvers.problem as p; "
            "assert sorted(p.ANALYSES) == ['materializations', 'transfer_schedule'], sorted(p.ANALYSES)")
    subprocess.run([sys.executable, "-c", code], check=True)
