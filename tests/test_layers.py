"""The module import graph runs one way: every module of shardflow/, passes/, models/ and kernels/
sits in one layer of LAYERS, and imports (at module level or inside a function) only from its own
layer and those below it, without cycles. A new module must be placed in the table."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "shardflow": "shardflow",
    "passes": "shardflow.passes",
    "models": "shardflow.models",
    "kernels": "shardflow.kernels",
}

# Lowest first; names are relative to the shardflow package ("shardflow" itself is its public
# namespace, shardflow/__init__.py); "pkg.*" is a package and every module in it.
LAYERS = [
    ("kernels", ["kernels", "kernels.*"]),
    # hetero.devices: the device catalogue (datasheet rows), which the solver's memory budget reads
    (
        "foundations",
        [
            "_compat",
            "specs",
            "links",
            "primitives",
            "elementwise_primitives",
            "ring_attention",
            "hlo",
            "hetero.devices",
        ],
    ),
    ("schedules", ["schedules", "schedules.*"]),
    ("program", ["mesh", "registry", "program", "slots"]),
    ("conversion", ["conversion", "costs"]),
    (
        "rules",
        [
            "rules",
            "rules.*",
            "attention_primitives",
            "attention_rule",
            "experts_primitives",
            "experts_rule",
            "cross_entropy_primitives",
            "cross_entropy_rule",
        ],
    ),
    ("passes", ["passes", "passes.*", "split_vjp"]),
    ("api", ["explain", "api", "search"]),
    (
        "pipelining",
        [
            "pipeline_tables",
            "pipeline_executor",
            "pipelining",
            "pipeline_solve",
            "attention",
            "experts",
            "cross_entropy",
            "predication",
        ],
    ),
    ("public namespace", ["shardflow"]),
    (
        "model parts",
        ["models.sharding", "models.config", "models.fp8", "models.moe", "models.attention", "models.pipeline"],
    ),
    ("models", ["models.llama", "models.gpt2", "models"]),
    ("checkpoints", ["models.hf", "models.hf.*"]),
    ("heterogeneous clusters", ["hetero", "hetero.*"]),
    ("trainer", ["train", "train.*"]),
]

# (importer, imported): lazy imports that may go up or close a cycle, each a documented plug-in
# point. sf.pipeline's rule loads the solver's side of a pipeline when one is solved.
PLUG_INS = {("pipelining", "pipeline_solve")}


def _short(module: str) -> str:
    return "shardflow" if module == "shardflow" else module.removeprefix("shardflow.")


def modules() -> dict:
    """{module name: file} of every module under the four folders."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def layer_of(module: str) -> int | None:
    name = _short(module)
    for i, (_, members) in enumerate(LAYERS):
        for member in members:
            if name == member or (member.endswith(".*") and name.startswith(member[:-1])):
                return i
    return None


def imports(module: str, path: Path, known: set) -> list:
    """[(imported module, line, lazy)] of ``module``'s imports of shardflow modules."""
    tree = ast.parse(path.read_text())
    lazy_lines = {
        node.lineno
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def known_prefix(name):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [known_prefix(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else known_prefix(base)
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target is not None and target != module:
                found.append((target, node.lineno, node.lineno in lazy_lines))
    return found


def graph():
    found = modules()
    return found, {m: imports(m, path, set(found)) for m, path in found.items()}


def test_every_module_has_a_layer():
    found, _ = graph()
    unplaced = [f"{path.relative_to(ROOT)} ({_short(m)})" for m, path in found.items() if layer_of(m) is None]
    assert not unplaced, "modules in no layer of LAYERS: " + ", ".join(unplaced)


def test_no_module_imports_from_a_higher_layer():
    found, edges = graph()
    upward = []
    for module, targets in edges.items():
        for target, line, lazy in targets:
            if (_short(module), _short(target)) in PLUG_INS and lazy:
                continue
            mine, theirs = layer_of(module), layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(
                    f"{found[module].relative_to(ROOT)}:{line}: {_short(module)} ({LAYERS[mine][0]}) imports "
                    f"{_short(target)} ({LAYERS[theirs][0]})"
                )
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycles():
    found, edges = graph()
    follows = {
        m: {(t, line) for t, line, lazy in targets if not ((_short(m), _short(t)) in PLUG_INS and lazy)}
        for m, targets in edges.items()
    }
    done, cycles = set(), []

    def visit(module, stack, lines):
        if module in stack:
            start = stack.index(module)
            cycle = stack[start:] + [module]
            cycles.append(
                " -> ".join(f"{found[a].relative_to(ROOT)}:{n}" for a, n in zip(cycle, lines[start:]))
                + f" -> {cycle[-1]}"
            )
            return
        if module in done:
            return
        for target, line in sorted(follows[module]):
            visit(target, stack + [module], lines + [line])
        done.add(module)

    for module in sorted(follows):
        visit(module, [], [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layers_name_no_missing_module():
    """Every name of the table is a module (an honest table: no stale entries)."""
    found, _ = graph()
    names = {_short(m) for m in found}
    stale = [
        member
        for _, members in LAYERS
        for member in members
        if not (member in names or (member.endswith(".*") and any(n.startswith(member[:-1]) for n in names)))
    ]
    assert not stale, f"names in LAYERS that are no module: {stale}"
