"""No import cycles among simdist's modules.

The graph is built statically with ``ast`` from every module of the package (the kernels
too, which install as ``simdist.kernels``): every ``import`` and ``from ... import``
counts, at module level, inside functions and under ``if TYPE_CHECKING`` alike. A
function-level import only postpones a cycle to run time, and a type-checking one still
ties the two modules together for a reader, so neither is an exception. An edge goes to
the module itself, never to its package's ``__init__`` merely because Python runs it first:
the ``__init__`` files re-export, and a cycle through them would be found from their own
imports.

Run ``python tests/test_imports.py`` to print the whole graph (module: what it imports).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from kernel_checks import fresh_python

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"simdist": ROOT / "simdist", "simdist.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the installed package layout."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "simdist" and parts[:1] == ["kernels"]:
                continue  # simdist/kernels is not where simdist.kernels comes from
            out[name] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The simdist module ``name`` denotes (a package, a module, or a name inside one)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" mod
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for t in targets:
            mod = _resolve(t, known)
            if mod and mod != name:
                found.add(mod)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(g):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(g[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(g.get(nxt, ()))))
    return None


def test_graph_sees_function_level_imports() -> None:
    # the checker must be able to fail: a function-level import is an edge
    src = "def f():\n    from simdist.run import Run\n"
    tmp = ROOT / "build" / "test_imports_probe.py"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(src)
    try:
        known = {**modules(), "simdist.probe": tmp}
        assert imports_of("simdist.probe", tmp, known) == {"simdist.run"}
    finally:
        tmp.unlink()
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    g = graph()
    assert "simdist.run" in g and "simdist.kernels.registry" in g
    cycle = find_cycle(g)
    assert cycle is None, "import cycle among simdist modules: " + " -> ".join(cycle)


MODELS = {
    "simdist.models.fc_mnist": "FCMNIST",
    "simdist.models.gpt2": "GPT2",
    "simdist.models.gpt2_tp": "GPT2TP",
    "simdist.models.bert": "Bert",
    "simdist.models.t5": "T5",
    "simdist.models.transformer": "Transformer",
}


def test_models_declare_every_kernel_module_they_call() -> None:
    # A run warms (compiles or cache-loads) only its model's kernel_modules before training:
    # one the model reaches through its imports but does not declare would load inside the
    # first step and count in its time. Declared = the kernel modules its module reaches.
    import importlib

    from simdist.kernels import registry

    g = graph()
    for module, cls in MODELS.items():
        reached, todo = set(), [module]
        while todo:
            for dep in g.get(todo.pop(), ()):
                if dep not in reached:
                    reached.add(dep)
                    todo.append(dep)
        kernels = {d.rsplit(".", 1)[1] for d in reached if d.startswith("simdist.kernels.")}
        want = kernels & set(registry.MODULES) - set(registry.COMMON)
        declared = getattr(importlib.import_module(module), cls).kernel_modules
        assert want <= set(declared), f"{cls}.kernel_modules lacks {sorted(want - set(declared))}"
        assert set(declared) <= set(registry.MODULES), cls
    assert "layernorm" in want  # the check sees kernels reached through helper modules


def test_a_run_imports_no_optional_heavyweights() -> None:
    # Every rank of every run imports simdist.train: PyTorch (an optional reference, seconds
    # to import) or transformers there would cost every run, on every rank; so would
    # scipy.linalg (~0.4 s) for the one BLAS pointer kernels/blas.py and numba take from it.
    code = (
        "import sys, simdist.train, simdist.events;"
        "from simdist.kernels import registry; registry.warm_all(['linear']);"
        "heavy = {'torch', 'transformers', 'tensorboard', 'scipy.linalg'};"
        "print(*sorted(heavy & set(sys.modules)))"
    )
    imported = fresh_python(code)
    assert imported == "", f"simdist.train imported {imported}"


if __name__ == "__main__":
    mods = sys.argv[1:]
    for name, deps in sorted(graph().items()):
        if not mods or name in mods:
            print(f"{name}: {', '.join(sorted(d for d in deps if d != 'simdist'))}")
