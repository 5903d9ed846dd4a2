"""docs/design.md's import rules: every stage may import ``contract/`` (the facts several stages read,
standard library and numpy only: the bundle contract, the quantization schemes, the byte-level table, atomic
writes, text normalisation, the chat format), and ``contract/`` imports nothing of the project and no torch; ``train/`` never imports ``serve/`` or
``export/``; ``serve/`` never imports ``train/`` or ``export/`` (each stage reads only the files the previous one
wrote); ``export/`` may use all of them. Checked statically: every ``.py`` file of a package is parsed with ``ast``
and every import in it — at the top, inside a function or a ``try``, relative ones resolved, and
``importlib.import_module`` / ``__import__`` of a string literal — is compared with the forbidden packages, so an
import on a path no test happens to run is caught too. (``serve/`` never importing torch is also checked at run
time by ``tests/test_serve_api.py::test_serve_never_imports_torch``.)

No import cycles: the modules of the Python packages (``contract/``, ``train/``, ``serve/``, ``export/`` and
``rust_runtime/*.py``) and their imports — the same ones, lazy and ``TYPE_CHECKING`` ones included — form a graph
without a cycle; a cycle is reported module by module. (A type that would close a cycle is a ``typing.Protocol`` of
what the lower module uses.)"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

# package → the packages (and their modules) it may not import.
FORBIDDEN = {
    "contract": ("train", "serve", "export", "rust_runtime", "torch", "onnxruntime"),
    "train": ("serve", "export"),
    "serve": ("train", "export", "torch"),
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path, root: Path) -> str:
    """The package a relative import in ``path`` is resolved against (``__package__`` at run time)."""
    name = _module_name(path, root)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file ``path`` of the tree ``root``. ``from m import a``
    yields ``m`` and ``m.a`` (``a`` may be a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package(path, root).split(".")
                anchor = ".".join(pkg[:len(pkg) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            yield node.lineno, node.args[0].value


def violations(root: Path, package: str, forbidden: tuple[str, ...]) -> list[str]:
    """``"train/x.py:12 imports serve.lm"`` for every import of a ``forbidden`` package (or one of its modules) by
    a file under ``root/package``, sorted; each file and line named once per forbidden module."""
    out = set()
    for f in sorted((root / package).rglob("*.py")):
        for line, name in imports(f, root):
            if any(name == bad or name.startswith(bad + ".") for bad in forbidden):
                out.add(f"{f.relative_to(root).as_posix()}:{line} imports {name}")
    return sorted(out)


def test_contract_imports_nothing_of_the_project():
    bad = violations(ROOT, "contract", FORBIDDEN["contract"])
    assert not bad, ("docs/design.md: contract/ imports nothing of the project and no torch (every stage reads it); "
                     "move the piece it needs into contract/: " + "; ".join(bad))


def test_train_imports_neither_serve_nor_export():
    bad = violations(ROOT, "train", FORBIDDEN["train"])
    assert not bad, ("docs/design.md: train/ never imports serve/ or export/ (export may use train, not the other "
                     "way round); move the shared piece into contract/: " + "; ".join(bad))


def test_serve_imports_neither_train_nor_export():
    """Serving never loads the trainer, the corpus reader, the exporter or torch: what it shares with them is in
    contract/."""
    bad = violations(ROOT, "serve", FORBIDDEN["serve"])
    assert not bad, "docs/design.md: serve/ reaches the other stages only through contract/: " + "; ".join(bad)
    reached = {name for f in sorted((ROOT / "serve").rglob("*.py")) for _, name in imports(f, ROOT)}
    assert {"contract.bundle", "contract.quant", "contract.byte_level"} <= reached  # the rule is about real imports


PACKAGES = ("contract", "train", "serve", "export", "rust_runtime")


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module → the modules of ``packages`` it imports (every import :func:`imports` sees, resolved to the longest
    module name that is a file of the tree: ``from serve import load`` is an edge to ``serve``'s ``__init__``).
    ``rust_runtime`` counts only its top-level Python files (``rust_runtime/*.py``; the rest is the Rust crate)."""
    files = {}
    for pkg in packages:
        found = (root / pkg).glob("*.py") if pkg == "rust_runtime" else (root / pkg).rglob("*.py")
        files |= {_module_name(f, root): f for f in sorted(found)}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    return {mod: {r for _, name in imports(f, root) if (r := resolve(name)) and r != mod} for mod, f in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as the shortest path
    from the component's first module (sorted) back to itself: ``["a", "b", "a"]``. Sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # recursive: the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for comp in components:
        start = min(comp)
        paths, queue = {start: [start]}, [start]
        while queue:  # breadth first inside the component, back to start
            v = queue.pop(0)
            for w in sorted(graph[v] & comp):
                if w == start:
                    found.append([*paths[v], start])
                    queue = []
                    break
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    queue.append(w)
    return sorted(found)


def plant(root: Path, files: dict[str, str]) -> None:
    """Write a planted source tree under ``root``: relative path -> text (dedented)."""
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text), encoding="utf-8")


def test_no_import_cycles_in_the_python_packages():
    graph = import_graph(ROOT)
    assert {"contract.bundle", "serve.lm", "train.run", "export.pipeline", "rust_runtime"} <= set(graph)
    assert "serve.generation" in graph["serve.lm"]  # the graph sees real imports
    found = cycles(graph)
    assert not found, ("import cycles (move the shared piece into the lower module, or type the higher one with a "
                       "typing.Protocol): " + "; ".join(" -> ".join(c) for c in found))


def test_the_cycle_check_sees_lazy_and_type_checking_cycles(tmp_path):
    files = {
        "serve/__init__.py": "from serve.a import A\n",
        "serve/a.py": "from serve.b import B\n",
        "serve/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from serve.a import A\n",
        "serve/c.py": "def f():\n    from serve import d\n",
        "serve/d.py": "import serve.c\n",
        "serve/e.py": "import serve.a\nimport json\n",
    }
    plant(tmp_path, files)
    graph = import_graph(tmp_path, ("serve",))
    assert graph["serve.e"] == {"serve.a"} and graph["serve"] == {"serve.a"}
    assert cycles(graph) == [["serve.a", "serve.b", "serve.a"], ["serve.c", "serve.d", "serve.c"]]


def test_the_check_finds_every_kind_of_import(tmp_path):
    """The checker itself: a planted tree with each way of importing a forbidden package is reported, file and
    line, and the allowed imports (stdlib, train's own modules, relative ones inside train) are not."""
    files = {
        "train/__init__.py": "",
        "train/ok.py": "import json\nfrom train.model import LlamaForCausalLM\nfrom . import errors\nimport serve_extra\n",
        "train/top.py": "import os\nimport serve.lm as lm\n",
        "train/lazy.py": "def f():\n    try:\n        from export import onnx\n    except ImportError:\n        pass\n",
        "train/sub/__init__.py": "from ..model import x\n",
        "train/sub/deep.py": "from serve import load\n",
        "train/dyn.py": "import importlib\nm = importlib.import_module('export.pipeline')\nn = __import__('serve')\n",
    }
    plant(tmp_path, files)
    assert violations(tmp_path, "train", FORBIDDEN["train"]) == [
        "train/dyn.py:2 imports export.pipeline",
        "train/dyn.py:3 imports serve",
        "train/lazy.py:3 imports export",
        "train/lazy.py:3 imports export.onnx",
        "train/sub/deep.py:1 imports serve",
        "train/sub/deep.py:1 imports serve.load",
        "train/top.py:2 imports serve.lm",
    ]
    assert list(imports(tmp_path / "train/sub/__init__.py", tmp_path)) == [(1, "train.model"), (1, "train.model.x")]
