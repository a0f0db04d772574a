"""The house rules, checked cheaply on the source (AST, no JAX): modules and functions a reader can
take in one sitting, one list of mesh axes, the trainer and the CLI at the top of the import graph
with no cycle below them, and BENCHMARKS.md a page of current results."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "meshlm"
MODULE_LINES = 600
FUNCTION_LINES = 80
# Over the limits on purpose: (the size it may not grow past, the reason). The list may only shrink:
# an entry that is no longer over its limit fails the test until it is removed, and one that grows
# fails too.
EXCEPTIONS: dict[str, tuple[int, str]] = {}  # "module::function": (lines pinned, why); empty today


def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(SRC).as_posix(): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def _module_name(rel: str) -> str:
    return ".".join(("meshlm", *Path(rel).with_suffix("").parts)).removesuffix(".__init__")


def _oversized(modules: dict[str, ast.Module]) -> dict[str, int]:
    """{module or module::function: lines} of everything over its limit."""
    out = {}
    for rel, tree in modules.items():
        lines = (SRC / rel).read_text().count("\n")
        if lines > MODULE_LINES:
            out[rel] = lines
        for node in ast.walk(tree):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
                out[f"{rel}::{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_modules_and_functions_a_reader_can_take_in_one_sitting():
    over = _oversized(_modules())
    assert over.keys() - EXCEPTIONS.keys() == set(), (
        f"over {MODULE_LINES} lines per module or {FUNCTION_LINES} per function: split where the concepts split"
    )
    assert EXCEPTIONS.keys() - over.keys() == set(), "no longer over the limit: take it off EXCEPTIONS"
    grown = {k: (n, EXCEPTIONS[k][0]) for k, n in over.items() if n > EXCEPTIONS[k][0]}
    assert not grown, f"an exception grew (lines now, pinned): {grown}"


def test_the_size_check_sees_a_long_function_and_a_long_module(tmp_path):
    """The check itself, on made-up source: it must not pass vacuously."""
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    tree = ast.parse(f"def long():\n{body}\n")
    global SRC
    real, SRC = SRC, tmp_path
    try:
        (tmp_path / "f.py").write_text(ast.unparse(tree))
        (tmp_path / "m.py").write_text("\n" * (MODULE_LINES + 1))
        assert _oversized({"f.py": tree, "m.py": ast.parse("")}).keys() == {"f.py::long", "m.py"}
    finally:
        SRC = real


def _imports(tree: ast.Module, name: str, top_level_only: bool) -> set[str]:
    """The meshlm modules a module imports (`from meshlm import x` counts meshlm.x when x is one)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("meshlm")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshlm"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_trainer_and_the_cli_sit_at_the_top():
    """Only the CLI imports the trainer; nothing below the CLI imports it. Conversion (interop) and
    everything else import neither (convert used to import the trainer for `code_version`)."""
    modules = _modules()
    names = {_module_name(rel) for rel in modules}
    for rel, tree in modules.items():
        name = _module_name(rel)
        imported = _imports(tree, name, top_level_only=False) & names
        if not name.startswith("meshlm.cli") and name != "meshlm.__main__":
            assert not {m for m in imported if m.startswith("meshlm.cli")}, f"{name} imports the CLI"
            assert "meshlm.trainer" not in imported, f"{name} imports the trainer"
        if name.startswith("meshlm.interop"):
            assert not imported & {"meshlm.trainer", "meshlm.train_loop", "meshlm.resume"}, name


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def test_no_import_cycle_between_modules():
    """Module-level imports form no cycle (lazy imports inside functions are how the model and the
    parallel code call each other; they are not counted)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]  # the check sees one
    modules = _modules()
    names = {_module_name(rel) for rel in modules}
    graph = {}
    for rel, tree in modules.items():
        name = _module_name(rel)
        imported = _imports(tree, name, top_level_only=True) & names
        # importing a.b runs package a's __init__ first: not an arrow between concerns
        graph[name] = {m for m in imported if not name.startswith(m + ".") and m != name}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_one_list_of_mesh_axes():
    """The mesh axis names are listed once (`axes.MESH_AXES`): no other literal collection names three
    or more of them, and ParallelConfig's size fields are that list in that order."""
    from meshlm.axes import MESH_AXES
    from meshlm.config import ParallelConfig

    for rel, tree in _modules().items():
        if rel == "axes.py":
            continue
        for node in ast.walk(tree):
            names = set()
            if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                names = {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            elif isinstance(node, ast.Call):  # dict(stage=..., data=..., ...) or f(stage=..., data=...)
                names = {k.arg for k in node.keywords if k.arg}
            assert len(names & set(MESH_AXES)) < 3, f"{rel}:{node.lineno} lists mesh axes; use axes.MESH_AXES"
    fields = [f.name for f in dataclasses.fields(ParallelConfig)]
    assert fields[: len(MESH_AXES)] == list(MESH_AXES)


# ------------------------------------------------------------------------------ BENCHMARKS.md


def _markdown():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _markdown

        return _markdown
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_benchmarks_page_is_a_page_of_current_results():
    """Under 300 lines (history beside it, linked both ways); every benchmark's marked section exactly
    once across the two files, so a rerun with --write finds it."""
    page, history = (ROOT / "BENCHMARKS.md").read_text(), (ROOT / "BENCHMARKS-history.md").read_text()
    assert page.count("\n") < 300
    assert "BENCHMARKS-history.md" in page and "BENCHMARKS.md" in history
    both = page + history
    starts = re.findall(r"<!-- (\S+):start -->", both)
    assert len(starts) == len(set(starts))
    for name in starts:
        holder = page if f"<!-- {name}:start -->" in page else history
        assert holder.index(f"<!-- {name}:start -->") < holder.index(f"<!-- {name}:end -->"), name
    written = set()
    for script in (ROOT / "benchmarks").glob("*.py"):
        written |= set(re.findall(r'(?:write_section|publish)\(\s*"([\w.-]+)"', script.read_text()))
    assert written <= set(starts), f"benchmarks write sections that neither file has: {written - set(starts)}"


def test_a_rerun_replaces_its_table_and_moves_the_old_one_to_the_history(tmp_path):
    md = _markdown()
    page, history = tmp_path / "B.md", tmp_path / "H.md"
    page.write_text("# B\n\n<!-- a:start -->\nold a\n<!-- a:end -->\n")
    history.write_text(f"# H\n\n<!-- b:start -->\nold b\n<!-- b:end -->\n\n{md.REPLACED}\n\nintro\n")
    md.write_section("a", "new a", page, history)
    md.write_section("b", "new b", page, history)  # a section kept in the history is rewritten there
    md.write_section("a", "new a", page, history)  # the same table again: nothing to move
    assert page.read_text() == "# B\n\n<!-- a:start -->\nnew a\n<!-- a:end -->\n"
    h = history.read_text()
    assert "<!-- b:start -->\nnew b\n<!-- b:end -->" in h
    replaced = h.split(md.REPLACED)[1]
    assert "### `a`, replaced on" in replaced and "old a" in replaced and "old b" in replaced
    assert replaced.count("### ") == 2
