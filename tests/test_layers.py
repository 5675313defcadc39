"""The packages depend one way: commands -> rl -> m3jax (the model library) -> sharding.

Read from the source (every import statement, module level or inside a function), so a lazy import
cannot hide a dependency or a cycle.
"""

import ast
import gc
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("sharding", "m3jax", "rl")
# The user commands sit on top of every layer and may import anything.
COMMANDS = ("m3jax.train", "m3jax.eval", "m3jax.convert", "m3jax.plot", "m3jax.demo", "m3jax.plan")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _parse(source: str) -> ast.Module:
    """ast.parse with garbage collection held off. CPython 3.11 (3.11.7 here) keeps the AST constructor's recursion
    depth in state the whole interpreter shares (cpython gh-106905): a collection inside the constructor runs Python
    code (finalizers), where another thread can take the GIL, and a traceback that thread prints parses its source
    lines too. That raised "SystemError: AST constructor recursion depth mismatch" here once (2026-12-06, a stray
    thread of tests/test_judge_reward.py). Without a collection the constructor runs no Python code."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if enabled:
            gc.enable()


def _imports(name: str) -> list[tuple[str, tuple[str, ...]]]:
    """(imported module, names taken from it) for every import in `name`'s source."""
    tree = _parse(MODULES[name].read_text())
    is_pkg = MODULES[name].name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = tuple(a.name for a in node.names)
            # `from pkg import module` imports the module itself
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            out += [(s, ()) for s in subs] + [(base, tuple(n for n in names if f"{base}.{n}" not in MODULES))]
    return [(m, n) for m, n in out if m.split(".")[0] in PACKAGES]


def _resolve(target: str) -> str | None:
    """The project module an import statement loads (a name inside a module resolves to the module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


GRAPH = {m: sorted({r for t, _ in _imports(m) if (r := _resolve(t)) and r != m}) for m in MODULES}


def _is_command(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in COMMANDS)


def test_the_command_modules_exist():
    assert all(c in MODULES for c in COMMANDS), [c for c in COMMANDS if c not in MODULES]


@pytest.mark.parametrize("layer, forbidden", [
    ("sharding", ("m3jax", "rl")),  # model-agnostic machinery
    ("m3jax", ("rl",)),  # the model library (commands excepted)
])
def test_lower_layers_do_not_import_higher_ones(layer, forbidden):
    bad = [(m, t) for m, targets in GRAPH.items() if m.split(".")[0] == layer and not _is_command(m)
           for t in targets if t.split(".")[0] in forbidden or _is_command(t)]
    assert not bad, bad


def test_rl_does_not_import_the_commands():
    bad = [(m, t) for m, targets in GRAPH.items() if m.startswith("rl") for t in targets if _is_command(t)]
    assert not bad, bad


def test_grpo_math_does_not_import_generation():
    bad = [(m, t) for m, targets in GRAPH.items() if m.startswith("rl.grpo") for t in targets
           if t.startswith(("rl.generation", "rl.trainer", "rl.rewards"))]
    assert not bad, bad


def test_no_private_names_across_packages():
    bad = []
    for m in MODULES:
        for target, names in _imports(m):
            if target.split(".")[0] != m.split(".")[0]:
                bad += [(m, target, n) for n in names if n.startswith("_")]
                bad += [(m, target) for part in target.split(".")[1:] if part.startswith("_")]
    assert not bad, bad


def test_no_import_cycles():
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for t in GRAPH[m]:
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    # a package's __init__ re-exporting its own modules is not a cycle between modules
    cycles = [c for c in cycles if not any(_is_reexport(a, b) for a, b in zip(c, c[1:]))]
    assert not cycles, cycles


def _is_reexport(importer: str, imported: str) -> bool:
    return MODULES[importer].name == "__init__.py" and imported.startswith(importer + ".")
