"""The rooms import downward only, and no modules import each other in a circle.

workers (one GPU) < cluster (between GPUs) < router (a request's journey) < experiments (runs, simulation,
analysis, lesson) < benchmarks; inside experiments/, its own rooms in EXPERIMENTS' order. Every import
counts, those inside functions and under TYPE_CHECKING too.
"""
import ast

from tests.conftest import ROOT

ROOMS = ["workers", "cluster", "router", "experiments", "benchmarks"]     # bottom to top
# experiments/'s files and folders, bottom to top: what the config is made of, the config, serving
# real points, the simulator, the report, the commands that run them, the analysis, the lesson, the
# commands above those, and the results' scripts.
EXPERIMENTS = ["progress", "hardware", "workload", "config", "compose", "serving", "sim", "report", "run",
               "server", "analysis", "lesson", "plan", "profile", "validate", "roofline", "gpu_stages",
               "gpu_timing", "gpu_check", "docs_config", "cli", "results"]


def modules() -> dict[str, ast.Module]:
    out = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The project's modules that `tree` imports (a name imported from a package counts as its module
    when it is one: `from experiments.serving import compare` is experiments.serving.compare)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                    for a in node.names}
    return {m for m in out if m.split(".")[0] in ROOMS}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(tree, set(mods)) - {name} for name, tree in mods.items()}


def test_no_module_imports_a_room_above_its_own():
    rank = {room: i for i, room in enumerate(ROOMS)}
    upward = sorted(f"{m} imports {dep}" for m, deps in graph().items() for dep in deps
                    if rank[dep.split(".")[0]] > rank[m.split(".")[0]])
    assert upward == []


def test_experiments_rooms_import_downward_only():
    """What two of experiments/'s rooms share lives in the lower one, so each reads without those above it."""
    g = graph()
    inner = {m: m.split(".")[1] for m in g if m.startswith("experiments.")}
    assert sorted(set(inner.values()) - set(EXPERIMENTS)) == [], "a new room of experiments/: place it in EXPERIMENTS"
    rank = {room: i for i, room in enumerate(EXPERIMENTS)}
    upward = sorted(f"{m} imports {dep}" for m, room in inner.items() for dep in g[m]
                    if dep in inner and rank[inner[dep]] > rank[room])
    assert upward == []


def test_no_modules_import_each_other_in_a_circle():
    g = graph()
    circles = [c for c in _components(g) if len(c) > 1]
    assert circles == [], f"import circles: {circles}"


def _components(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph (iterative: no recursion limit)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(g.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_the_checks_see_an_upward_import_and_a_circle():
    """The two checks above are not vacuous: an upward import and a two-module circle are found."""
    tree = ast.parse("def f():\n    from experiments import hardware\n")
    assert imports(tree, {"experiments.hardware"}) == {"experiments.hardware"}
    assert sorted(_components({"a": {"b"}, "b": {"a"}, "c": {"a"}})) == [["a", "b"], ["c"]]
    g = graph()                                         # and the real graph is read, lazy imports too
    assert "router.journey" in g["router.router"] and "cluster.events" in g["router.worker_events"]
    assert "workers.gguf_import" in g["workers.config"]
