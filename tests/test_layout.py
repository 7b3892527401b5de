"""The package's shape, read statically: no import cycles between modules or between
folders, no module past 400 lines, public JAX only.

The checks parse the source with `ast` and import nothing, so they are fast
and see imports inside functions too: a cycle closed by a lazy import still
ties the two modules together.

The folders are layers (`test_folders_are_layered`): each imports only
folders below it. Each subpackage of `podracer` is one node (`anakin/`,
`sebulba/`, `session/`, `data/`, `orchestrate/`, `provision/`, `protocol/`,
`envs/`, `ppo/`, `vtrace/`, `es/`), and each module at the top of the package
is a node of its own (`config`, `policy`, `evaluate`, `command`, ...): they
sit at different heights, shared settings and types near the bottom, commands
at the top, and lumped together they would tie every folder into one cycle.
From the bottom up, roughly:

    errors, bounds, config, networks, protocol/, envs/   what everything shares
    session/, es/, ppo/, vtrace/, acting                  the run's host side; agents
    anakin/, sebulba/                                     architectures
    policy, data/, video, plot                            what uses a trained run
    orchestrate/, evaluate, provision/, command           the command line
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "podracer"

# Edges that close a cycle someone is removing; each names the import to drop.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()

MAX_LINES = 400
# Modules past MAX_LINES that are being split. Delete an entry once it is short.
KNOWN_LONG_MODULES: set[str] = set()


def _module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the file, at module level or inside functions.

    `from a.b import c` yields `a.b.c`: `c` may be a submodule or a name in
    `a.b`; `_defining_module` tells which. Imports under `if TYPE_CHECKING:`
    are left out: they name a type for annotations (the run spec a layer is
    handed from above) and never run.
    """
    names = []
    tree = ast.parse(path.read_text(), str(path))
    annotations_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
                        and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                        for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


def _defining_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of the package, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """Edges (importer, imported) between the package's modules -> where ("path:line").

    Importing `a.b.c` is an edge to `a.b.c` only: the parent packages run too,
    but they only re-export, and counting them would tie every submodule to its
    package's `__init__`.
    """
    modules = _module_files(root)
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in modules.items():
        for name, line in _imported_names(module, path):
            if name.split(".")[0] != PACKAGE:
                continue
            target = _defining_module(name, modules)
            if target and target != module:
                where = edges.setdefault((module, target), [])
                if f"{path.relative_to(root)}:{line}" not in where:  # one per statement
                    where.append(f"{path.relative_to(root)}:{line}")
    return edges


def _reachable(start: str, successors: dict[str, set[str]]) -> set[str]:
    seen, stack = {start}, [start]
    while stack:
        for nxt in successors.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def strongly_connected(edges) -> list[set[str]]:
    """The components of two or more modules that each reach every other: the cycles.

    By definition rather than Tarjan's algorithm: the graph has about a hundred
    nodes, and `reach(v) & reached_by(v)` is easy to check by eye.
    """
    forward: dict[str, set[str]] = {}
    backward: dict[str, set[str]] = {}
    for a, b in edges:
        forward.setdefault(a, set()).add(b)
        backward.setdefault(b, set()).add(a)
    components, placed = [], set()
    for node in sorted(forward):
        if node in placed:
            continue
        component = _reachable(node, forward) & _reachable(node, backward)
        placed |= component
        if len(component) > 1:
            components.append(component)
    return components


def _describe(component: set[str], edges) -> str:
    lines = [" <-> ".join(sorted(component))]
    for (a, b), where in sorted(edges.items()):
        if a in component and b in component:
            lines.append(f"    {a} -> {b}  ({', '.join(where)})")
    return "\n".join(lines)


def test_no_import_cycles():
    edges = import_graph()
    assert edges, "no imports found: is ROOT the repository?"
    known = {edge: where for edge, where in edges.items() if edge in KNOWN_CYCLE_EDGES}
    cycles = strongly_connected({e: w for e, w in edges.items() if e not in known})
    assert not cycles, "import cycles (break each by moving what both need into a module both " \
        "import, or by turning one import round):\n" + "\n".join(_describe(c, edges) for c in cycles)

    # An allowlisted edge that closes no cycle any more must leave the allowlist.
    components = strongly_connected(edges)
    stale = sorted((a, b) for a, b in KNOWN_CYCLE_EDGES if not any({a, b} <= c for c in components))
    assert not stale, f"{stale} no longer close a cycle; delete them from KNOWN_CYCLE_EDGES"


def folder_of(module: str) -> str:
    """The layer of a module: its subpackage of `podracer` (`podracer.anakin`), or itself at the top."""
    return ".".join(module.split(".")[:2])


def folder_graph(edges) -> dict[tuple[str, str], list[str]]:
    """Edges (folder, folder) between different folders -> the import lines ("path:line") behind them."""
    folders: dict[tuple[str, str], list[str]] = {}
    for (a, b), where in edges.items():
        if folder_of(a) != folder_of(b):
            folders.setdefault((folder_of(a), folder_of(b)), []).extend(where)
    return folders


def shortest_cycle(component: set[str], edges) -> list[str]:
    """One shortest loop through the component, as its nodes in order (the first again at the end)."""
    successors: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        if a in component and b in component:
            successors.setdefault(a, []).append(b)
    best: list[str] = []
    for start in sorted(component):
        paths, seen = [[start]], {start}
        while paths and not (best and len(paths[0]) >= len(best)):
            path = paths.pop(0)
            if start in successors.get(path[-1], ()):
                best = path + [start]
                break
            for nxt in successors.get(path[-1], ()):
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append(path + [nxt])
    return best


def _describe_loop(component: set[str], edges) -> str:
    loop = shortest_cycle(component, edges)
    steps = [f"    {a} -> {b}  ({', '.join(edges[(a, b)])})" for a, b in zip(loop, loop[1:])]
    return "\n".join([" -> ".join(loop), *steps])


def test_folders_are_layered():
    """No folder imports one that imports it back, through any path, counting imports in functions."""
    folders = folder_graph(import_graph())
    assert ("podracer.orchestrate", "podracer.session") in folders, "folders not found: is ROOT the repository?"
    cycles = strongly_connected(folders)
    assert not cycles, "folders that import each other (move what both need into a folder below both, " \
        "or hand it in from above):\n" + "\n".join(_describe_loop(c, folders) for c in cycles)


def test_no_module_over_400_lines():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for path in _module_files().values()}
    long = {path: n for path, n in sorted(lengths.items()) if n > MAX_LINES}
    unexpected = {path: n for path, n in long.items() if path not in KNOWN_LONG_MODULES}
    assert not unexpected, (f"modules over {MAX_LINES} lines (split each by responsibility): "
                            f"{unexpected}")
    stale = sorted(KNOWN_LONG_MODULES - set(long))
    assert not stale, f"{stale} are {MAX_LINES} lines or fewer now; delete them from KNOWN_LONG_MODULES"


NAMED_TUPLE_API = {"_asdict", "_replace", "_fields", "_make", "_field_defaults"}  # public, despite the "_"


def _private(name: str) -> bool:
    return (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
            and name not in NAMED_TUPLE_API)


def private_jax_uses(root: Path = ROOT) -> list[str]:
    """Where the package reaches into JAX's private parts ("path:line: what").

    An import of a private JAX or jaxlib module (`jax._src...`), a private
    attribute of the `jax` or `jaxlib` module, or a private attribute fetched
    by name (`getattr(lowered, "_lowering")`): what JAX does not promise to
    keep, which its next release may change.
    """
    found = []
    for module, path in _module_files(root).items():
        where = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("jax", "jaxlib"):
                names = [f"{node.value.id}.{node.attr}"]
            for name in names:
                parts = name.split(".")
                if parts[0] in ("jax", "jaxlib") and any(_private(p) for p in parts[1:]):
                    found.append(f"{where}:{node.lineno}: {name}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                    and _private(node.args[1].value):
                found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_public_jax_only():
    uses = private_jax_uses()
    assert not uses, "private JAX (use its public API instead):\n" + "\n".join(uses)
