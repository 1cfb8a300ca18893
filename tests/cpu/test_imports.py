"""The house's import rules, read from the source (no import runs): no module reaches another
module's ``_private`` name, and the import graph of ``ws_lab`` (its kernels and post-processor
included) has no cycle, function-level imports counted."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# import name -> folder of the checkout (pyproject's package-dir)
PACKAGES = {"ws_lab.kernels": ROOT / "kernels", "ws_lab.postproc": ROOT / "postproc",
            "ws_lab": ROOT / "ws_lab", "tests": ROOT / "tests"}


def _sources():
    for folder in ("ws_lab", "kernels", "postproc", "bench", "tests"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _module_path(name: str) -> Path | None:
    """The file of a lab module or package, or None (not the lab's)."""
    for prefix, folder in PACKAGES.items():
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix) + 1:].replace(".", "/") if name != prefix else ""
            base = folder / rest if rest else folder
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return path
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(tree):
    """(imported module, names taken from it, alias the module is bound to) for every import."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], a.asname
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if _module_path(sub) is not None:  # a submodule, bound to its name
                    yield sub, [], a.asname or a.name
                else:
                    yield node.module, [a.name], None


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found, modules = [], {}
    for module, names, alias in _imports(tree):
        if _module_path(module) is None:
            continue
        found += [f"{path.relative_to(ROOT)}: from {module} import {n}" for n in names
                  if _private(n)]
        if alias:
            modules[alias] = module
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            found.append(f"{path.relative_to(ROOT)}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_reaches_another_modules_private_name():
    offences = [o for path in _sources() for o in _offences(path)]
    assert offences == []


def test_the_check_catches_a_private_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ws_lab.check import _byte_span\nfrom ws_lab.kernels.decode import paged\n"
                   "paged._check_indices\n")
    bad_rel = ROOT / "tests" / "cpu" / "_probe_bad.py"
    bad_rel.write_text(bad.read_text())
    try:
        assert len(_offences(bad_rel)) == 2
    finally:
        bad_rel.unlink()


def _graph() -> dict[str, set[str]]:
    """Lab module -> the lab modules it imports (at any depth of the file)."""
    graph = {}
    for path in _sources():
        if path.is_relative_to(ROOT / "tests") or path.is_relative_to(ROOT / "bench"):
            continue
        name = _name_of(path)
        edges = {m for m, _, _ in _imports(ast.parse(path.read_text())) if _module_path(m)}
        graph[name] = {m for m in edges if _module_path(m) != path}
    return graph


def _name_of(path: Path) -> str:
    for prefix, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            return ".".join([prefix, *parts]) if parts else prefix
    raise AssertionError(path)


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert "ws_lab.kernels.decode.paged" in graph and "ws_lab.bench" in graph
    assert _cycle(graph) is None


def test_the_cycle_check_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
