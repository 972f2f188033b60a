"""The Python package's layout (issue 45): no import circle and no upward
import in `python/kolo`, read with `ast` alone (no framework is imported).

Every import counts: module-level, function-level and under `if`/`try`
(a lazy import that closes a circle is a circle all the same). Relative
imports are resolved; `from X import name` where `X.name` is a module
imports that module; `horovod.*` is kolo's alias of `kolo.horovod.*`.
Importing `a.b.c` also runs the packages `a` and `a.b`, so those count
as imported too, except the importer's own packages (already running)."""

import ast
import pathlib
import sys


ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "kolo"
# the native module (maturin's `module-name`): a leaf
NATIVE = {"kolo._kolo"}

# the layers, lowest first: a module may import its own layer or a lower
# one, never a higher one (see `layer`)
FRAMEWORKS = ("torch", "tensorflow", "keras", "_keras", "ray", "runner")
# which other framework packages a framework package may import: Keras 3's
# torch backend reduces with horovod.torch; horovod.tensorflow wraps Keras
# optimizers with _keras (and holds horovod.tensorflow.keras); horovod.ray
# runs on the launcher's elastic classes
FRAMEWORK_USES = {
    "_keras": {"torch"},
    "tensorflow": {"_keras"},
    "keras": {"_keras", "tensorflow"},
    "ray": {"runner"},
}
# above everything: the `horovod` package itself (`horovod.run` names the
# launcher) and kolo's benchmarks (of the frameworks' APIs)
TOP = {"kolo.horovod", "kolo.bench", "kolo.bench_torch"}


def layer(module):
    """0: kolo's framework-free core (`kolo._rounds`, `kolo.executor`...);
    1: `kolo.torch` (the torch.distributed backend and in-place PyTorch);
    2: the rest of `kolo.horovod`, chiefly `kolo.horovod.common` (what
    every framework's Horovod API shares); 3: Horovod's framework packages
    (`FRAMEWORKS`); 4: `TOP`."""
    parts = module.split(".")
    if module in TOP:
        return 4
    if parts[:2] == ["kolo", "horovod"]:
        return 3 if len(parts) > 2 and parts[2] in FRAMEWORKS else 2
    if parts[:2] == ["kolo", "torch"]:
        return 1
    return 0


def framework(module):
    return module.split(".")[2] if layer(module) == 3 else None


def module_files(package=PACKAGE):
    """{module name: path} for every .py file of the package."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _absolute(name):
    if name == "horovod" or name.startswith("horovod."):
        return "kolo." + name
    return name


def imports_of(module, path, known):
    """[(imported module, line, explicit)] for every import in `path` that
    names a module of `known` (kolo's own); not explicit: a package that
    importing a module of it runs first."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [_absolute(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = _absolute(node.module)
            targets = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in known else source)
        else:
            continue
        for target in targets:
            # the packages that importing `target` runs first, less the
            # importer's own (those are running already)
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in known or name == module:
                    continue
                if i < len(parts) and module.startswith(name + "."):
                    continue
                found.append((name, node.lineno, i == len(parts)))
    return found


def import_graph(package=PACKAGE):
    """{module: {imported module: (first line, explicit)}} within the
    package, and {module: path}."""
    files = module_files(package)
    known = set(files) | NATIVE
    graph = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for target, line, explicit in imports_of(module, path, known):
            if target not in edges or explicit and not edges[target][1]:
                edges[target] = (line, explicit)
    return graph, files


def cycles(graph):
    """One import circle ([a, b, ..., a]) in each group of modules that
    import each other (Tarjan's strongly connected components)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle(graph, group) for group in groups]


def _circle(graph, group):
    """A shortest circle through the group's first module, within the group."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for target in sorted(graph[path[-1]]):
            if target == start:
                return path + [start]
            if target in group and target not in seen:
                seen.add(target)
                paths.append(path + [target])
    raise AssertionError(f"no circle in {group}")


def describe(cycle, graph, files, root=ROOT):
    return "\n".join(f"  {a} -> {b} ({files[a].relative_to(root)}:{graph[a][b][0]})" for a, b in zip(cycle, cycle[1:]))


def upward_imports(graph, files, root=ROOT):
    """['a -> b (file:line)'] for each import of a higher layer, and of a
    framework package another framework package may not use."""
    bad = []
    for module, edges in sorted(graph.items()):
        for target, (line, explicit) in sorted(edges.items()):
            if target in NATIVE or not explicit:
                continue
            upward = layer(target) > layer(module)
            mine, theirs = framework(module), framework(target)
            if mine and theirs and mine != theirs and theirs not in FRAMEWORK_USES.get(mine, ()):
                upward = True
            if upward:
                bad.append(f"{module} -> {target} ({files[module].relative_to(root)}:{line})")
    return bad


def test_no_import_circle():
    graph, files = import_graph()
    assert len(graph) > 50, "the package's modules were not found"
    found = cycles(graph)
    assert not found, "import circles in python/kolo:\n" + "\n\n".join(describe(c, graph, files) for c in found)


def test_no_upward_import():
    graph, files = import_graph()
    bad = upward_imports(graph, files)
    assert not bad, "imports of a higher layer (core < kolo.torch < horovod.common < frameworks):\n  " + "\n  ".join(
        bad
    )


def test_the_checks_find_a_circle_and_an_upward_import(tmp_path):
    """The checks themselves, on a package made here: a circle closed by a
    function-level relative import of a submodule named in `from . import`,
    and an import of a framework package from common through the
    `horovod` alias."""
    package = tmp_path / "kolo"
    (package / "horovod" / "common").mkdir(parents=True)
    (package / "horovod" / "torch").mkdir()
    (package / "__init__.py").write_text("from ._kolo import x\n")
    (package / "horovod" / "__init__.py").write_text("")
    (package / "horovod" / "common" / "__init__.py").write_text("")
    (package / "horovod" / "common" / "a.py").write_text("from . import b\n")
    (package / "horovod" / "common" / "b.py").write_text("def f():\n    from .a import g\n")
    (package / "horovod" / "common" / "c.py").write_text("import horovod.torch.ops\n")
    (package / "horovod" / "torch" / "__init__.py").write_text("")
    (package / "horovod" / "torch" / "ops.py").write_text("from ..common import c\n")
    graph, files = import_graph(package)
    found = cycles(graph)
    assert sorted(found) == [
        ["kolo.horovod.common.a", "kolo.horovod.common.b", "kolo.horovod.common.a"],
        ["kolo.horovod.common.c", "kolo.horovod.torch.ops", "kolo.horovod.common.c"],
    ], found
    assert describe(sorted(found)[0], graph, files, tmp_path).splitlines() == [
        "  kolo.horovod.common.a -> kolo.horovod.common.b (kolo/horovod/common/a.py:1)",
        "  kolo.horovod.common.b -> kolo.horovod.common.a (kolo/horovod/common/b.py:2)",
    ]
    bad = upward_imports(graph, files, tmp_path)
    assert bad == ["kolo.horovod.common.c -> kolo.horovod.torch.ops (kolo/horovod/common/c.py:1)"], bad


if __name__ == "__main__":
    graph, files = import_graph()
    for module, edges in sorted(graph.items()):
        print(module, "->", ", ".join(sorted(edges)))
    for cycle in cycles(graph):
        print("circle:\n" + describe(cycle, graph, files))
    print("\n".join(upward_imports(graph, files)))
