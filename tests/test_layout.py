"""The package's layout: the layers, and imports that only run down them.

Every `from amp...` import in amp/, at module level or inside a function, is read from the
source. The graph of modules has no cycle, and a module imports only from its own layer or a
lower one, so each layer can be read without the ones above it. A folder is one concern and one
layer: the recorders every layer reports into (diagnostics/) sit low, the audit that runs the
others' machinery (auditing/) near the top.
"""

import ast
import pathlib

import amp

ROOT = pathlib.Path(amp.__file__).parent

# Lowest first. A module belongs to the layer of the most specific entry naming it or a package
# above it.
LAYERS = (
    # foundations: the state, the opt levels, the hardware, the patch ledger, the rank agreement,
    # the op tables and the kernels
    (
        "amp._state",
        "amp.properties",
        "amp.hardware",
        "amp.patching",
        "amp.distributed",
        "amp.lists",
        "amp.kernels",
    ),
    ("amp.apex_interop",),  # apex's state object, optimizer wrappers, which apex is importable
    ("amp.diagnostics",),  # what amp says: trace, overflow report, origin watch, warnings
    ("amp.casting",),  # O1 and regions
    # O2/O3 weights, the optimizer amp steps with its gradient stash and skip decision, the
    # engines: below loss scaling, whose scale_loss drives the stash and hands it the scale
    ("amp.weights",),
    ("amp.scaling",),  # loss scalers, scale_loss, GradScaler
    ("amp.auditing",),  # the audit runs the others' machinery
    # the front door
    (
        "amp.frontend",
        "amp.kernel_advice",
        "amp.__main__",
        "amp",
        "amp.lightning",
        "amp.transformers",
    ),
)


def _module_name(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module):
    matches = [
        (len(name), index)
        for index, layer in enumerate(LAYERS)
        for name in layer
        if name != "amp" and (module == name or module.startswith(name + "."))
    ]
    if not matches:
        assert module == "amp", module
        return len(LAYERS) - 1
    return max(matches)[1]


def _imports(path):
    """The amp modules that `path` imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            )
            base = ".".join(base + ([node.module] if node.module else []))
            # `from amp import lists` depends on amp.lists; `from amp.x import name` on amp.x.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        found.update(target for target in targets if target.split(".")[0] == "amp")
    return (found & MODULES.keys()) - {name}


MODULES = {_module_name(path): path for path in ROOT.rglob("*.py")}
GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def test_the_top_level_is_the_front_door_and_the_fixed_folders_stay():
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= 9, top  # the front door (frontend, kernel_advice, __main__) and foundations
    assert (ROOT / "lists" / "torch_overrides.py").is_file()
    assert (ROOT / "kernels" / "multi_tensor.cu").is_file()
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert {"casting", "scaling", "weights", "diagnostics", "lists", "kernels"} <= packages
    assert "compat" not in packages  # the top-level compat/apex package owns that name


def test_every_subpackage_says_what_lives_there():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init} has no docstring"


def test_imports_only_run_down_the_layers():
    upward = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def test_no_import_cycle():
    done, path = set(), []

    def visit(module):
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        path.append(module)
        for target in sorted(GRAPH[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(GRAPH):
        visit(module)
