"""The runtime (`kvtier`, what vLLM's venv installs) and the tools (`kvtier-tools`) apart: the
runtime imports nothing of the tools, carries none of their dependencies, and the two
distributions are of one release."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import kvtier
import kvtier_tools

RUNTIME = Path(kvtier.__file__).parent
REPO = RUNTIME.parents[1]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_runtime_imports_nothing_of_the_tools() -> None:
    # With the CUDA tests and benchmarks: the GPU machine runs them with the runtime alone.
    files = sorted(RUNTIME.rglob("*.py")) + sorted((REPO / "connector/tests/cuda").glob("*.py"))
    assert len(files) > 40
    offenders = {
        str(path.relative_to(REPO)): sorted(
            n for n in _imports(path) if n.startswith("kvtier_tools")
        )
        for path in files
    }
    assert not {path: names for path, names in offenders.items() if names}


def test_the_import_scan_sees_a_tools_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvtier_tools.server import VllmServer\n")
    assert "kvtier_tools.server" in _imports(module)


def _project(path: Path) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads(path.read_text())["project"]
    return project


def test_the_runtime_carries_no_dependency_of_the_tools_only() -> None:
    runtime = _project(REPO / "pyproject.toml")
    tools = _project(REPO / "connector" / "tools" / "pyproject.toml")
    runtime_deps = {str(d).split("==")[0].lower() for d in runtime["dependencies"]}  # type: ignore[attr-defined]
    tools_deps = {str(d).split("==")[0].lower() for d in tools["dependencies"]}  # type: ignore[attr-defined]
    assert "tomli-w" in tools_deps
    assert not (tools_deps - {"kvtier"}) & runtime_deps
    assert "scripts" not in runtime  # the `kvtier` command is the tools'


def test_one_release_of_both() -> None:
    runtime = _project(REPO / "pyproject.toml")
    tools = _project(REPO / "connector" / "tools" / "pyproject.toml")
    version = runtime["version"]
    assert version == tools["version"] == kvtier.__version__ == kvtier_tools.__version__
    assert f"kvtier=={version}" in tools["dependencies"]  # type: ignore[operator]
