"""The code's shape, checked: packages whose modules import each other one way, library functions a
reader can hold in view, layers that do not reach up. Imports inside functions count the same as
those at the top: a cycle hidden in a function is still a cycle."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("platforms", "weight_sync", "inference_server", "rollout", "trainer_bridge")
BELOW = {"platforms": (), "weight_sync": ("platforms",), "inference_server": ("platforms", "weight_sync"),
         "rollout": ("platforms",)}           # what each may import of the others (trainer_bridge: all)
MAX_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def imports(path: Path, known: dict) -> set[str]:
    """Project modules `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_a_package():
    known = modules()
    graph = {m: {t for t in imports(f, known) if t != m and t.split(".")[0] == m.split(".")[0]}
             for m, f in known.items()}
    assert cycles(graph) == []


def test_lower_layers_do_not_import_upper_ones():
    """The rollout process, the servers and weight sync never load the trainer's package (nor
    each other's, beyond what BELOW allows)."""
    known = modules()
    wrong = []
    for m, f in known.items():
        pkg = m.split(".")[0]
        if pkg not in BELOW:
            continue
        for t in imports(f, known):
            other = t.split(".")[0]
            if other != pkg and other not in BELOW[pkg]:
                wrong.append(f"{m} imports {t}")
    assert wrong == []


def test_no_library_function_over_60_lines():
    long = []
    for m, f in modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{m}.{node.name}: {n} lines")
    assert long == []
