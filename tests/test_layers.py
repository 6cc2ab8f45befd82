"""The package's layers, checked: every import (including those inside functions) points
down the picture in docs/architecture.md, and importing one side does not load the other.

    errors, _malloc      <- everything
    wire   (manifest, chunks, codecs, gRPC chunk messages, bulk framing, token/TLS, stubs)
    algo   (outer optimizers, schedules, DyLU, grouping)
    ps     (the server)          worker (the workers and clients)      job (model, data)
    flags  (each server/worker setting declared once: argparse, configs, argv)
    tools  (status view, evaluator, export)
    bench  (simulator, suites, demo, perf)
    fleet  (a server and workers as Ray actors; Ray imported lazily)
    cli    (the command)
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "asyncdiloco"

#: layer -> the layers its modules may import (besides their own)
ALLOWED = {
    "errors": set(),
    "_malloc": set(),
    "_atomic": set(),
    "wire": {"errors"},
    "algo": {"errors"},
    "ps": {"errors", "_malloc", "_atomic", "wire", "algo"},
    "worker": {"errors", "_malloc", "_atomic", "wire", "algo"},
    "job": {"errors", "algo"},
    "flags": {"errors", "wire", "algo", "ps", "worker", "job"},
    "tools": {"errors", "_malloc", "_atomic", "wire", "algo", "ps", "worker", "job", "flags"},
    "bench": {"errors", "_malloc", "_atomic", "wire", "algo", "ps", "worker", "job", "flags", "tools"},
    "fleet": {"errors", "wire", "algo", "ps", "worker", "job", "flags", "tools", "bench"},
    "cli": {"errors", "_malloc", "_atomic", "wire", "algo", "ps", "worker", "job", "flags", "bench", "tools", "fleet"},
}

#: (module, imported module) pairs allowed across the picture, each with its reason.
CROSSINGS = {
    # A regional server (ps/tier/upstream.py) is itself a worker of its parent server: its link
    # talks to the parent through the workers' own client, imported only when --parent is set.
    ("asyncdiloco.ps.tier.upstream", "asyncdiloco.worker.client"),
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "asyncdiloco" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: pathlib.Path, module: str = "") -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path``: ``import``, ``from`` (relative
    ones resolved against ``module``), and ``importlib.import_module`` / ``__import__``
    with a constant name."""
    package = module.split(".")[:-1] if not path.name == "__init__.py" else module.split(".")
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y / from .. import y
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                out += [(node.lineno, target)] + [(node.lineno, f"{target}.{a.name}") for a in node.names]
            elif node.module:
                out.append((node.lineno, node.module))
                if node.module == "asyncdiloco":  # the root's lazy exports load whole layers
                    out.append((node.lineno, "asyncdiloco.(root: import from the defining module)"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


def test_every_module_belongs_to_a_layer():
    stray = [
        m
        for m, _ in _modules()
        if m.count(".") >= 1
        and _layer(m) not in ALLOWED
        and m != "asyncdiloco.__init__"
        and m != "asyncdiloco.__main__"
    ]
    assert not stray, f"modules outside the layers of ALLOWED (put them in a layer's folder): {stray}"


def test_imports_point_down_the_layers():
    wrong = []
    for module, path in _modules():
        own = _layer(module)
        if own not in ALLOWED:  # asyncdiloco/__init__.py (lazy exports) and __main__.py
            continue
        for line, target in _imports(path, module):
            layer = _layer(target)
            if layer is None or layer == own:
                continue
            if layer not in ALLOWED[own] and (module, target) not in CROSSINGS:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} {own} -> {layer} ({target})")
    assert not wrong, "imports against the layer picture:\n" + "\n".join(wrong)


def _name(module: str) -> str:
    """A package's module name without its ``.__init__``."""
    return module.removesuffix(".__init__")


#: Line cap of a module (the generated stubs in wire/_proto aside).
MAX_MODULE_LINES = 600

#: Modules allowed over ``MAX_MODULE_LINES``, each with its reason.
LONG_MODULES: dict[str, str] = {}


def test_no_module_is_over_the_line_cap_without_a_reason():
    long = {
        _name(m): n
        for m, path in _modules()
        if "._proto" not in m and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    over = {m: n for m, n in long.items() if m not in LONG_MODULES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them, or name the reason in LONG_MODULES): {over}"
    stale = set(LONG_MODULES) - set(long)
    assert not stale, f"LONG_MODULES names modules no longer over the cap: remove {sorted(stale)}"


#: (module, private name imported from another module of the package) pairs allowed, with the reason.
PRIVATE_IMPORTS: dict[tuple[str, str], str] = {}


def _private_imports(path: pathlib.Path, module: str) -> list[tuple[int, str]]:
    """(line, "module._name") for every ``from M import _name`` of ``path`` with M another
    module of the package (the generated stubs in wire/_proto aside)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if node.level:
            source = ".".join(package[: len(package) - node.level + 1] + ([source] if source else []))
        if source.startswith("asyncdiloco") and "._proto" not in source and source != module:
            out += [(node.lineno, f"{source}.{a.name}") for a in node.names if a.name.startswith("_")]
    return out


def test_no_private_name_is_imported_from_another_module():
    found = {(_name(m), name): line for m, path in _modules() for line, name in _private_imports(path, _name(m))}
    wrong = [f"{m}:{line} imports {name}" for (m, name), line in found.items() if (m, name) not in PRIVATE_IMPORTS]
    assert not wrong, "private names imported across modules (make them public, or move them):\n" + "\n".join(wrong)
    stale = set(PRIVATE_IMPORTS) - set(found)
    assert not stale, f"PRIVATE_IMPORTS names imports that are gone: remove {sorted(stale)}"


#: Import cycles allowed inside a layer (each its set of modules), with the reason.
CYCLES: dict[frozenset[str], str] = {}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                out.append(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_a_layer():
    """Every import counts, those inside functions and under TYPE_CHECKING too."""
    modules = {_name(m): path for m, path in _modules()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for _, target in _imports(path, m):
            while target and target not in modules:  # a name imported from a module: that module
                target = target.rpartition(".")[0]
            if target and target != m and _layer(target) == _layer(m) and _layer(m) is not None:
                graph[m].add(target)
    cycles = _cycles(graph)
    wrong = [sorted(c) for c in cycles if c not in CYCLES]
    assert not wrong, f"import cycles inside a layer (move the shared part down, or pass it in): {wrong}"
    stale = [sorted(c) for c in CYCLES if c not in cycles]
    assert not stale, f"CYCLES names cycles that are gone: remove {stale}"


def test_the_cycle_finder_sees_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]


#: (module, what importing it must not load)
SEPARATE = [
    ("asyncdiloco.worker.client", "asyncdiloco.ps"),
    ("asyncdiloco.worker.async_worker", "asyncdiloco.ps"),
    ("asyncdiloco.worker.sync_worker", "asyncdiloco.ps"),
    ("asyncdiloco.ps.server", "asyncdiloco.worker"),
    ("asyncdiloco.wire.grpc_chunks", "asyncdiloco.ps"),
    ("asyncdiloco.job.config", "asyncdiloco.worker"),
    ("asyncdiloco", "asyncdiloco.ps"),
    ("asyncdiloco.ps.server", "matplotlib"),
    ("asyncdiloco.fleet", "ray"),
    ("asyncdiloco.cli.app", "ray"),
]

#: Run in a fresh interpreter: these third-party packages are imported once, then each
#: case is a fork that imports its module, so a case costs asyncdiloco's own imports only.
#: None of them imports a forbidden module (the check would see it if one did).
_CHECKER = """
import importlib, json, os, sys
import google.protobuf, grpc, torch
results = {}
for module, forbidden in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(module)
            got = sorted(m for m in sys.modules if m == forbidden or m.startswith(forbidden + "."))
        except BaseException as exc:
            got = [f"(the import failed: {exc!r})"]
        os.write(w, json.dumps(got).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        results[f"{module} {forbidden}"] = json.loads(f.read() or b'["(the check crashed)"]')
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def loaded_by_import():
    """``"MODULE FORBIDDEN"`` -> the forbidden modules importing MODULE loaded, for SEPARATE."""
    done = subprocess.run(
        [sys.executable, "-c", _CHECKER, json.dumps(SEPARATE)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(("module", "forbidden"), SEPARATE)
@pytest.mark.multiprocess
def test_importing_one_side_does_not_load_the_other(module, forbidden, loaded_by_import):
    bad = loaded_by_import[f"{module} {forbidden}"]
    assert not bad, f"importing {module} loaded {bad}"


def test_public_names_resolve():
    import asyncdiloco

    for name in asyncdiloco.__all__:
        assert getattr(asyncdiloco, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        asyncdiloco.nonexistent  # noqa: B018


def test_the_import_walk_sees_relative_and_dynamic_imports(tmp_path):
    probe = tmp_path / "flat.py"
    probe.write_text(
        "import importlib\nfrom ..ps import config\nfrom . import client\n"
        "importlib.import_module('asyncdiloco.ps.server')\n__import__('asyncdiloco.ps.store')\n"
    )
    found = {target for _, target in _imports(probe, "asyncdiloco.worker.flat")}
    assert {
        "asyncdiloco.ps.config",
        "asyncdiloco.worker.client",
        "asyncdiloco.ps.server",
        "asyncdiloco.ps.store",
    } <= found


#: The server's rooms, lowest first (docs/architecture.md, "The server's rooms"): an import
#: inside ``asyncdiloco.ps`` stays in its room or points to a lower one. A room is a
#: subfolder, or a set of top-level modules: the shared core at the bottom, the state in the
#: middle, the process (server.py and the package's lazy exports) at the top.
PS_ROOMS = (
    ("core", {"config", "books", "model", "registry", "core"}),
    ("pull", {"pull"}),
    ("push", {"push"}),
    ("sync", {"sync"}),
    ("durable", {"durable"}),
    ("state", {"state"}),
    ("tier", {"tier"}),
    ("watch", {"watch"}),
    ("transport", {"transport"}),
    ("server", {"server", "__init__"}),
)


def _ps_room(module: str) -> int | None:
    """The rank of ``module``'s room in ``PS_ROOMS`` (None outside ``asyncdiloco.ps``)."""
    parts = module.split(".")
    if parts[:2] != ["asyncdiloco", "ps"]:
        return None
    name = parts[2] if len(parts) > 2 else "__init__"
    ranks = [rank for rank, (_, members) in enumerate(PS_ROOMS) if name in members]
    assert ranks, f"{module} is in no room of PS_ROOMS: add it to one"
    return ranks[0]


def test_server_imports_point_down_its_rooms():
    wrong = []
    for module, path in _modules():
        own = _ps_room(module)
        if own is None:
            continue
        for line, target in _imports(path, module):
            room = _ps_room(target)
            if room is not None and room > own:
                where = path.relative_to(PACKAGE.parent)
                wrong.append(f"{where}:{line} {PS_ROOMS[own][0]} -> {PS_ROOMS[room][0]} ({target})")
    assert not wrong, "imports up the server's rooms (PS_ROOMS):\n" + "\n".join(wrong)
