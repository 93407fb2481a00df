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
    # data folders are listed as packages too (setuptools warns about each one otherwise)
    data = {p for p in listed if p.endswith(".data")}
    for p in data:
        parent, _ = p.rsplit(".", 1)
        assert (ROOT / dirs[parent] / "data").is_dir() and p in cfg["package-data"], p
    assert found | data == listed


# ----------------------------------------------------------------------------- module graph

def _module_name(path: Path) -> str:
    """``probes/kineto_scan.py`` -> ``ridgeline.probes.kineto_scan`` (a package: its name)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["ridgeline", *parts])


MODULES = {_module_name(p): p for pkg in ("agent", "aggregator", "probes") for p in sorted((ROOT / pkg).rglob("*.py"))}


def _project_imports(name: str, path: Path):
    """(line, imported module, bound name or None, imported attribute or None) of every
    import of a project module in ``path``, function-level imports included (a circle
    closed inside a function is a circle all the same), relative imports resolved."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    yield node.lineno, a.name, a.asname, None
        elif isinstance(node, ast.ImportFrom):
            mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:          # ``from . import kineto_scan``: the module itself
                    yield node.lineno, sub, a.asname or a.name, None
                elif mod in MODULES:
                    yield node.lineno, mod, None, a.name


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_circle_finder_finds_a_circle():
    """The check below is not vacuous: the finder reports a circle of three and a pair."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": set()}
    assert sorted(_circles(g)) == [["a", "b", "c"], ["d", "e"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_project_modules():
    """No module imports, directly or through others, one that imports it back (the Kineto
    readers once did: kineto and kineto_typed)."""
    graph = {name: {mod for _, mod, _, _ in _project_imports(name, path) if mod != name}
             for name, path in MODULES.items()}
    assert "ridgeline.probes.events" in graph["ridgeline.probes.kineto"]    # edges are found
    circles = _circles(graph)
    assert not circles, circles


def test_probes_use_no_private_name_of_another_module():
    """A probe module reads another module's public names only: no ``from .x import _y``
    and no ``x._y`` on an imported project module (the Kineto readers once shared their
    internals this way)."""
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("ridgeline.probes."):
            continue
        bound = {}
        for lineno, mod, alias, attr in _project_imports(name, path):
            if attr is not None and attr.startswith("_") and not attr.startswith("__") and mod != name:
                bad.append(f"{path.relative_to(ROOT)}:{lineno} imports {attr} from {mod}")
            if alias is not None and mod != name:
                bound[alias] = mod
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {bound[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)
