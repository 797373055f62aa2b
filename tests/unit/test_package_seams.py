"""The package's seams, read from its source with ast (nothing is imported):

- only ``aidaptiv_ds/zero3/`` reaches into DeepSpeed; elsewhere only its public entry points are used
  (``deepspeed.initialize``, ``deepspeed.init_distributed``, ``deepspeed.zero.Init``, ``deepspeed.__version__``;
  the launcher runs as a process), and the io-bench imports DeepSpeed's libaio handle, its baseline;
- the harness drives the product as a user does and imports nothing from ``aidaptiv_ds.zero3``;
- no module imports, at module level or inside a function, a module that imports it back.

Imports inside functions count: the loop that autoload.py and zero3/initialize.py once formed ran through
function-level imports only.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "aidaptiv_ds"

# What a module outside zero3/ may use of DeepSpeed: its documented entry points (and what they return).
PUBLIC_DEEPSPEED = (
    "deepspeed.initialize",
    "deepspeed.init_distributed",
    "deepspeed.zero.Init",
    "deepspeed.__version__",
)
# The io-bench compares our engine with DeepSpeed's libaio handle: that baseline is its one exception.
BASELINE = {"aidaptiv_ds/harness/io_bench.py": ("deepspeed.ops.op_builder.AsyncIOBuilder",)}


def package_modules() -> Dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _parse(path: pathlib.Path) -> ast.AST:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # so that only the outermost of `deepspeed.a.b.c` is reported
    return tree


def _from_target(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.AST) -> Optional[Tuple[str, List[str]]]:
    """(root name, attributes) of an attribute chain ``root.a.b``; None for anything else."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def _source_in_strings(tree: ast.AST) -> List[Tuple[int, ast.AST]]:
    """(line, tree) of every string constant that is Python importing something (a script for ``python -c``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            try:
                out.append((node.lineno, ast.parse(node.value)))
            except SyntaxError:
                continue
    return out


def deepspeed_uses(module: str, path: pathlib.Path) -> List[Tuple[int, str]]:
    """(line, dotted name) for every DeepSpeed import of the file, wherever it is (``from deepspeed.a import
    b`` reads ``deepspeed.a.b``), also in Python code held in a string (a script run with ``python -c``), and
    every attribute chain on a name bound to DeepSpeed (``deepspeed.a.b``, also through
    ``import deepspeed as ds``)."""
    tree = _parse(path)
    for line, script in _source_in_strings(tree):
        for node in ast.walk(script):
            node.lineno = line  # report the string's line in the file
        for parent in ast.walk(script):
            for child in ast.iter_child_nodes(parent):
                child.parent = parent
        tree.body.append(script)
    bound: Dict[str, str] = {}  # local name -> the DeepSpeed module or object it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepspeed":
                    found.append((node.lineno, alias.name))
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["deepspeed"] = "deepspeed"
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(module, path, node)
            if target.split(".")[0] == "deepspeed":
                for alias in node.names:
                    found.append((node.lineno, f"{target}.{alias.name}"))
                    bound[alias.asname or alias.name] = f"{target}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.parent, ast.Attribute):
            chain = _dotted(node)
            if chain and chain[0] in bound:
                root, attrs = chain
                found.append((node.lineno, ".".join([bound[root]] + attrs)))
    return sorted(set(found))


def _allowed(name: str, allowed) -> bool:
    return name == "deepspeed" or any(name == a or name.startswith(a + ".") for a in allowed)


def test_only_zero3_reaches_into_deepspeed():
    offences = []
    for module, path in package_modules().items():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel.startswith("aidaptiv_ds/zero3/"):
            continue
        allowed = PUBLIC_DEEPSPEED + BASELINE.get(rel, ())
        offences += [
            f"{rel}:{line}: {name}" for line, name in deepspeed_uses(module, path) if not _allowed(name, allowed)
        ]
    assert not offences, (
        "DeepSpeed internals used outside aidaptiv_ds/zero3/ (move them into zero3, their names "
        "into zero3/compat.py):\n" + "\n".join(offences)
    )


def test_the_checker_sees_every_kind_of_deepspeed_use(tmp_path):
    """The scan above finds function-level imports, aliases, relative package names and attribute chains."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import deepspeed\n"
        "def f():\n"
        "    import deepspeed.runtime.zero.stage3 as s3\n"
        "    from deepspeed.accelerator import get_accelerator\n"
        "    deepspeed.utils.logger.setLevel(30)\n"
        "    deepspeed.zero.Init(config_dict_or_path={})\n"
        "    return s3.DeepSpeedZeroOptimizer_Stage3, deepspeed.__version__.split('+')\n"
        "SCRIPT = 'import sys\\nfrom deepspeed.ops.op_builder import CPUAdamBuilder\\n'\n"
    )
    names = [name for _, name in deepspeed_uses("probe", source)]
    assert "deepspeed.runtime.zero.stage3" in names
    assert "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3" in names
    assert "deepspeed.accelerator.get_accelerator" in names
    assert "deepspeed.utils.logger.setLevel" in names
    assert "deepspeed.ops.op_builder.CPUAdamBuilder" in names
    assert sorted(n for n in names if not _allowed(n, PUBLIC_DEEPSPEED)) == [
        "deepspeed.accelerator.get_accelerator",
        "deepspeed.ops.op_builder.CPUAdamBuilder",
        "deepspeed.runtime.zero.stage3",
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
        "deepspeed.utils.logger.setLevel",
    ]


def package_imports(module: str, path: pathlib.Path, modules: Dict[str, pathlib.Path]) -> Set[str]:
    """The package's modules that ``module`` imports, at module level or inside functions. ``from a import b``
    counts as importing ``a.b`` when that is a module, else ``a``. Importing ``a.b.c`` also runs the packages
    ``a`` and ``a.b``, which count too, except the importer's own enclosing packages (already run by then)."""
    out = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(module, path, node)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != module and not module.startswith(prefix + "."):
                    out.add(prefix)
    return out


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of ``graph`` as [a, b, ..., a], or None if it is acyclic (iterative depth-first search)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def import_graph() -> Dict[str, Set[str]]:
    modules = package_modules()
    return {module: package_imports(module, path, modules) for module, path in modules.items()}


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_function_level_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hook.py").write_text("def patch():\n    from pkg.entry import run\n")
    (pkg / "entry.py").write_text("def run():\n    from pkg.hook import patch\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.hook": pkg / "hook.py", "pkg.entry": pkg / "entry.py"}
    graph = {m: package_imports(m, p, modules) for m, p in modules.items()}
    assert graph["pkg.hook"] == {"pkg.entry"} and find_cycle(graph) == ["pkg.entry", "pkg.hook", "pkg.entry"]


def test_the_harness_imports_nothing_from_zero3():
    """The harness drives the product as a user does (processes, the CLI, files, public functions)."""
    graph = import_graph()
    offences = [
        f"{m} imports {dep}"
        for m, deps in sorted(graph.items())
        if m.startswith("aidaptiv_ds.harness")
        for dep in sorted(deps)
        if dep.startswith("aidaptiv_ds.zero3")
    ]
    assert not offences, "\n".join(offences)
