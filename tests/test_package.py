"""The package's shape: imports point one way (no cycles, counting imports inside functions), and
every function is short enough to read in one sitting or says why it is not."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minigpt"
MAX_LINES = 60


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in the file."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_point_one_way():
    graph = imports_graph()
    assert len(graph) > 20 and "minigpt.kernels" in graph["minigpt.models.layers"]
    assert find_cycles(graph) == []


def test_sharding_depends_on_nothing_of_ours_but_the_config():
    graph = imports_graph()
    package = [m for m in graph if m == "minigpt.sharding" or m.startswith("minigpt.sharding.")]
    for name in set(package) - {"minigpt.sharding.__main__"}:  # the entry point runs explain
        outside = {m for m in graph[name] if not m.startswith("minigpt.sharding")}
        assert outside <= {"minigpt.config"}, name


def test_no_function_is_over_sixty_lines_without_saying_why():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_LINES and "long because" not in doc:
                    long.append(f"{module_name(path)}.{node.name}: {lines} lines")
    assert long == []
