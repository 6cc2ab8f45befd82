"""The wheel holds what an installed asyncdiloco needs, and matplotlib stays an extra.

The wheel is built from a copy of the sources in a temporary folder (so the checkout gets
no build/ or egg-info, and two runs of the suite never share one), without build
isolation, so no index is needed.
"""

from __future__ import annotations

import email.parser
import importlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

pytestmark = pytest.mark.multiprocess  # the wheel is built by pip in a child process

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncdiloco"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: the wheel cannot be built without build isolation (an index)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(PACKAGE, src / "asyncdiloco", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    out = tmp / "dist"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = out.glob("asyncdiloco-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def _names(wheel: zipfile.ZipFile) -> set[str]:
    return set(wheel.namelist())


def test_the_wheel_holds_every_module_of_the_package(wheel):
    names = _names(wheel)
    sources = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(sources - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert not [n for n in names if n.startswith("tests/")], "the test suite must not ship in the wheel"


def test_the_wheel_holds_the_perf_benchmarks_the_corpus_and_the_typing_files(wheel):
    names = _names(wheel)
    perf = {p.name for p in (PACKAGE / "bench" / "perf").glob("*.py")}
    assert {"perf_suite.py", "bench_transport.py", "bench_server.py", "bench_codec.py", "bench_overlap.py"} <= perf
    assert {f"asyncdiloco/bench/perf/{name}" for name in perf} <= names
    assert "asyncdiloco/job/data/tinyshakespeare.txt" in names
    stubs = {p.name for p in (PACKAGE / "wire" / "_proto").glob("*.pyi")}
    assert stubs and {f"asyncdiloco/wire/_proto/{name}" for name in stubs} <= names
    assert "asyncdiloco/py.typed" in names
    corpus = wheel.read("asyncdiloco/job/data/tinyshakespeare.txt")
    assert corpus == (PACKAGE / "job" / "data" / "tinyshakespeare.txt").read_bytes()


def _metadata(wheel: zipfile.ZipFile):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(meta).decode())


def test_matplotlib_is_only_in_the_bench_extra(wheel):
    meta = _metadata(wheel)
    requires = meta.get_all("Requires-Dist") or []
    core = [r for r in requires if "extra ==" not in r]
    assert not [r for r in core if r.lower().startswith("matplotlib")], f"matplotlib is a core requirement: {core}"
    bench = [r for r in requires if 'extra == "bench"' in r]
    assert any(r.lower().startswith("matplotlib") for r in bench), requires
    assert {"test", "bench", "peer"} <= set(meta.get_all("Provides-Extra") or [])
    assert any(r.startswith("torch") for r in core)


def test_the_wheel_installs_the_asyncdiloco_command(wheel):
    (entry,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry).decode()
    scripts = text.split("[console_scripts]", 1)[1].split("[", 1)[0]
    target = dict(line.replace(" ", "").split("=", 1) for line in scripts.strip().splitlines())["asyncdiloco"]
    module, func = target.split(":")
    assert f"{module.replace('.', '/')}.py" in _names(wheel)
    assert callable(getattr(importlib.import_module(module), func))
