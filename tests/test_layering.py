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
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


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
