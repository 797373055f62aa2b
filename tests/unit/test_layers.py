"""The layer table (scripts/layers.py) held against the package, read from its source with ast:

- every module lives in a wing of the table (the root holds only the public face and the entry points);
- no module imports a module of a wing above its own or beside it, nor one its wing must never import
  (the harness: zero3, activations, swap), at module level or inside a function;
- the same at the folder level: the graph of wings has no cycle;
- a module whose docstring says it imports nothing of ours (or nothing but one module) does so;
- docs/DESIGN.md holds the map the table makes.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
from typing import Dict, List, Set, Tuple

from test_package_seams import PACKAGE, _parse, find_cycle, package_imports, package_modules

ROOT = PACKAGE.parent
_spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


def imports_the_face(path: pathlib.Path) -> bool:
    """``import aidaptiv_ds`` or ``from aidaptiv_ds import name`` (a name of the root, not a submodule): the
    cycle check skips the importer's enclosing packages, but the root's public face is a wing of its own."""
    modules = package_modules()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import) and any(a.name == "aidaptiv_ds" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "aidaptiv_ds":
            if any(f"aidaptiv_ds.{a.name}" not in modules for a in node.names):
                return True
    return False


@functools.lru_cache(maxsize=None)
def wing_graph_edges() -> List[Tuple[str, str, str, str]]:
    """(importer wing, imported wing, importer module, imported module) for every import across wings."""
    modules = package_modules()
    edges = []
    for module, path in modules.items():
        deps = set(package_imports(module, path, modules))
        if module != "aidaptiv_ds" and imports_the_face(path):
            deps.add("aidaptiv_ds")
        for dep in deps:
            a, b = layers.wing_of(module), layers.wing_of(dep)
            if a != b:
                edges.append((a, b, module, dep))
    return tuple(sorted(edges))


def offences(edges) -> List[str]:
    return [f"{m} imports {d} ({a} may not import {b})" for a, b, m, d in edges if not layers.may_import(a, b)]


def test_every_module_lives_in_a_wing_of_the_table():
    known = layers.level_of()
    strays = [m for m in package_modules() if layers.wing_of(m) not in known]
    assert not strays, (
        "modules outside the wings of scripts/layers.py (the root keeps only __init__, cli, "
        "__main__ and autoload; put the module in its wing, or add a wing to the table):\n" + "\n".join(strays)
    )


def test_no_module_imports_upward_or_sideways():
    found = offences(wing_graph_edges())
    assert not found, "imports against the layer table (scripts/layers.py):\n" + "\n".join(found)


def test_the_wings_form_no_cycle():
    graph: Dict[str, Set[str]] = {}
    for a, b, _, _ in wing_graph_edges():
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    cycle = find_cycle(graph)
    assert cycle is None, "the wings import each other in a loop: " + " -> ".join(cycle)


def test_the_check_fails_on_an_upward_import():
    """The rule itself: down is allowed, up and sideways are not, and the harness never reaches zero3."""
    assert layers.may_import("job", "zero3") and layers.may_import("swap", "engine")
    up = [
        ("engine", "config", "aidaptiv_ds.engine.io", "aidaptiv_ds.config.resolve"),
        ("planner", "activations", "aidaptiv_ds.planner.memory", "aidaptiv_ds.activations.plan"),
        ("harness", "zero3", "aidaptiv_ds.harness.sweep", "aidaptiv_ds.zero3.runtime"),
        ("common", "engine", "aidaptiv_ds.common.sizes", "aidaptiv_ds.engine._C"),
    ]
    assert len(offences(up)) == 4
    assert offences([("zero3", "swap", "aidaptiv_ds.zero3.plan", "aidaptiv_ds.swap.budget_split")]) == []


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path):
    pkg = tmp_path / "aidaptiv_ds"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "config").mkdir()
    for f in ("__init__.py", "engine/__init__.py", "config/__init__.py", "config/resolve.py"):
        (pkg / f).write_text("")
    (pkg / "engine" / "io.py").write_text("def f():\n    from aidaptiv_ds.config.resolve import resolve\n")
    modules = {
        "aidaptiv_ds.engine.io": pkg / "engine" / "io.py",
        "aidaptiv_ds.config.resolve": pkg / "config" / "resolve.py",
        "aidaptiv_ds.config": pkg / "config" / "__init__.py",
    }
    deps = package_imports("aidaptiv_ds.engine.io", modules["aidaptiv_ds.engine.io"], modules)
    edges = [("engine", layers.wing_of(d), "aidaptiv_ds.engine.io", d) for d in deps]
    assert offences(edges), edges


def _docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(_parse(path)) or ""


def test_modules_that_say_they_import_nothing_of_ours_do_not():
    modules = package_modules()
    wrong = []
    for module, path in modules.items():
        text = " ".join(_docstring(path).split())
        deps = package_imports(module, path, modules) | ({"aidaptiv_ds"} if imports_the_face(path) else set())
        if layers.wing_of(module) == "common" and not module.endswith("common"):
            if deps - {"aidaptiv_ds.common"}:
                wrong.append(f"{module} is a leaf (common/) but imports {sorted(deps)}")
        if "imports nothing of ours" in text and deps - {"aidaptiv_ds.common"}:
            wrong.append(f"{module} says it imports nothing of ours but imports {sorted(deps)}")
        if "imports nothing but :mod:`" in text:
            allowed = text.split("imports nothing but :mod:`", 1)[1].split("`", 1)[0]
            extra = deps - {allowed, allowed.rsplit(".", 1)[0]}
            if extra:
                wrong.append(f"{module} says it imports nothing but {allowed} but imports {sorted(extra)}")
    assert not wrong, "\n".join(wrong)


def test_design_holds_the_map_the_table_makes():
    text = layers.DESIGN.read_text(encoding="utf-8")
    assert layers.current_map(text) == layers.render_map(), (
        "docs/DESIGN.md's map differs from scripts/layers.py: run python scripts/layers.py"
    )
