"""The import rules of the codebase, checked on the source: ``agent -> aggregator -> probes``,
and the aggregator never imports zmq, bcc, cupti or pynvml."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "probes": {"aggregator", "agent"},
    "aggregator": {"agent", "zmq", "bcc", "cupti", "pynvml"},
}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, _top(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, _top(node.module)


def _top(module: str) -> str:
    """The layer a module belongs to: ``ridgeline.probes.kineto`` -> ``probes``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "ridgeline" and len(parts) > 1 else parts[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for lineno, top in _imports(path):
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{lineno} imports {top}")
    assert not bad, "\n".join(bad)


def test_no_utils_modules():
    names = [p for pkg in ("agent", "aggregator", "probes") for p in (ROOT / pkg).rglob("utils.py")]
    assert not names


SOURCES = sorted(p for pkg in ("agent", "aggregator", "probes", "bench", "scripts", "tests")
                 for p in (ROOT / pkg).rglob("*.py"))


def test_every_import_uses_the_one_import_name():
    """The packages install as ridgeline.agent/.probes/.aggregator; a bare ``import agent``
    would work in the source tree (the repository root on sys.path) and fail when installed."""
    bad = []
    for path in SOURCES:
        for lineno, top in _bare_imports(path):
            bad.append(f"{path.relative_to(ROOT)}:{lineno} imports {top} outside ridgeline")
    assert not bad, "\n".join(bad)


def _bare_imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in ("agent", "probes", "aggregator"):
                yield node.lineno, name


def test_pyproject_lists_every_package_directory():
    import tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = {"ridgeline"}
    for pkg, src in dirs.items():
        if pkg == "ridgeline":
            continue
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src)
            found.add(".".join([pkg, *rel.parts]))
    assert found == listed
