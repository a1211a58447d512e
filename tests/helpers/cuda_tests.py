"""What the CUDA-only tests patch, read from their source (ast), so that a CPU test can check that
every attribute they patch still exists: CI has no GPU, and a renamed module attribute would
otherwise surface only on the next GPU run (the H200's first run found `_cupy_backend._devices`
gone).

A test is CUDA-only where pytest.mark.cuda reaches it: its decorators (directly, or through a
module-level name such as helpers.DEVICES or a file's BACKENDS), the file's `pytestmark`, or a
fixture it requests whose `params` carry the mark. The fixtures such a test requests from its own
file run only for it, so their bodies count too. Patches are `monkeypatch.setattr` and
`monkeypatch.delattr` calls, in both of monkeypatch's forms: (object, "name", ...) and
("module.name", ...); `raising=False` says the attribute may be absent, so those are left out.
"""

import ast
import dataclasses
import pathlib
from typing import Dict, Iterator, List, Optional, Set

from helpers import TESTS

__all__ = ["Patch", "patches", "patches_in"]

_PATCHING = ("setattr", "delattr")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One monkeypatch call of a CUDA-only test (or of a fixture only such tests use)."""

    where: str  # "path:line (function)", for the failure message
    target: Optional[ast.expr]  # the object patched; None for the ("module.name", ...) form
    name: Optional[str]  # the attribute (or the dotted path); None if not a string literal
    imports: Dict[str, str]  # the file's top-level imports: bound name -> "module" or "module:attr"


def patches(root: pathlib.Path = TESTS) -> List[Patch]:
    """Every patch the CUDA-only tests under `root` make, file by file."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name.startswith("test_") or path.name == "conftest.py":
            found.extend(patches_in(path.read_text(), str(path.relative_to(root)), root))
    return found


def patches_in(source: str, where: str, root: pathlib.Path = TESTS) -> List[Patch]:
    """The patches of the CUDA-only tests in one test file's `source`."""
    tree = ast.parse(source)
    imports = _imports(tree)
    marking = _marking_names(tree) | _imported_marking_names(tree, root)
    whole_file = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and _mentions_cuda(node.value, marking)
        for node in tree.body
    )
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    fixtures = {f.name: f for f in functions if any(_is_fixture(d) for d in f.decorator_list)}
    cuda_fixtures = {
        name
        for name, fixture in fixtures.items()
        if any(_mentions_cuda(d, marking) for d in fixture.decorator_list)
    }
    chosen = {}
    for function in functions:
        if not function.name.startswith("test"):
            continue
        requested = {a.arg for a in function.args.args}
        if (
            whole_file
            or any(_mentions_cuda(d, marking) for d in function.decorator_list)
            or requested & cuda_fixtures
        ):
            chosen[function.name] = function
            for name in requested & set(fixtures):
                chosen[name] = fixtures[name]
    return [
        Patch(f"{where}:{call.lineno} ({name})", target, attribute, imports)
        for name, function in chosen.items()
        for call, target, attribute in _patch_calls(function)
    ]


def _mentions_cuda(node: ast.AST, marking: Set[str]) -> bool:
    """Whether `node` holds pytest.mark.cuda, or a name bound to something that does."""
    for child in ast.walk(node):
        if isinstance(child, ast.Attribute) and child.attr == "cuda":
            owner = child.value
            if isinstance(owner, ast.Attribute) and owner.attr == "mark":
                return True
        if isinstance(child, ast.Name) and child.id in marking:
            return True
    return False


def _marking_names(tree: ast.Module) -> Set[str]:
    """The file's module-level names whose values carry pytest.mark.cuda (DEVICES, BACKENDS)."""
    return {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and _mentions_cuda(node.value, set())
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _imported_marking_names(tree: ast.Module, root: pathlib.Path) -> Set[str]:
    """Names a file imports from the tests' own modules (helpers) that carry pytest.mark.cuda."""
    names = set()
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or node.module is None or node.level:
            continue
        base = root.joinpath(*node.module.split("."))
        paths = [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()]
        if not paths:
            continue  # not one of the tests' own modules
        path = paths[0]
        marking = _marking_names(ast.parse(path.read_text()))
        names |= {alias.asname or alias.name for alias in node.names if alias.name in marking}
    return names


def _is_fixture(decorator: ast.expr) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, (ast.Attribute, ast.Name)) and (
        getattr(node, "attr", None) == "fixture" or getattr(node, "id", None) == "fixture"
    )


def _imports(tree: ast.Module) -> Dict[str, str]:
    """name -> "module" (import a.b [as c]) or "module:attr" (from a import b): the file's top-level
    imports, for resolving what a patch's target starts from."""
    bound = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:  # `import a.b` binds `a`
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    return bound


def _patch_calls(function: ast.FunctionDef) -> Iterator[tuple]:
    """(call, target, name) for each monkeypatch.setattr / delattr call in `function` that must
    find its attribute."""
    for call in ast.walk(function):
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr in _PATCHING
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "monkeypatch"
        ):
            continue
        raising = next((k.value for k in call.keywords if k.arg == "raising"), None)
        if isinstance(raising, ast.Constant) and raising.value is False:
            continue
        first = call.args[0] if call.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield call, None, first.value  # monkeypatch.setattr("module.name", value)
            continue
        second = call.args[1] if len(call.args) > 1 else None
        literal = isinstance(second, ast.Constant) and isinstance(second.value, str)
        yield call, first, second.value if literal else None
