"""The CUDA-only tests do not rot where CI cannot run them: every module attribute they patch
exists, checked here on the CPU (tests/helpers/cuda_tests.py reads what they patch from their
source)."""

import ast
import importlib
import pkgutil

import pytest

from helpers import cuda_tests, fake_cupy

PATCHES = cuda_tests.patches()

# What a fixture gives a CUDA test, made on the CPU: the root of a patch target that is a fixture
# rather than an import. A CUDA test patching through a new fixture fails below until it has one.
STAND_INS = {
    # tests/kernels/test_backends.py: the CuPy backend module; fake_cupy lets it import here.
    "cupy_backend": lambda monkeypatch: fake_cupy.install(monkeypatch)[0],
}


def _import(binding):
    """The object a file's import binds: "module" or "module:attr"."""
    module, _, attribute = binding.partition(":")
    if not attribute:
        return importlib.import_module(module)
    try:
        return importlib.import_module(f"{module}.{attribute}")
    except ModuleNotFoundError:
        return getattr(importlib.import_module(module), attribute)


def _resolve(node, imports, monkeypatch):
    """The object a patch target's expression (a name, or attributes of one) names."""
    if isinstance(node, ast.Attribute):
        return getattr(_resolve(node.value, imports, monkeypatch), node.attr)
    if isinstance(node, ast.Name) and node.id in imports:
        return _import(imports[node.id])
    if isinstance(node, ast.Name) and node.id in STAND_INS:
        return STAND_INS[node.id](monkeypatch)
    if isinstance(node, ast.Name):
        raise LookupError(
            f"`{node.id}` is neither imported at the file's top nor in STAND_INS "
            "(tests/test_cuda_tests.py): add what that fixture gives a CUDA test there"
        )
    raise LookupError(
        f"cannot follow `{ast.unparse(node)}` without a GPU: patch a module, or an attribute "
        "path from an imported name or a fixture"
    )


def missing(patch, monkeypatch):
    """Why `patch` would fail on a GPU (its attribute is not where it looks), or None."""
    if patch.name is None:
        return f"{patch.where}: write the attribute's name as a string literal, to be checked here"
    if patch.target is None:  # monkeypatch.setattr("module.name", ...)
        try:
            pkgutil.resolve_name(patch.name)
        except (ImportError, AttributeError, ValueError) as error:
            return f"{patch.where}: {patch.name!r} does not resolve ({error})"
        return None
    try:
        owner = _resolve(patch.target, patch.imports, monkeypatch)
    except (ImportError, AttributeError, LookupError) as error:
        return f"{patch.where}: {ast.unparse(patch.target)}: {error}"
    if not hasattr(owner, patch.name):
        return f"{patch.where}: {ast.unparse(patch.target)} has no attribute {patch.name!r}"
    return None


@pytest.mark.parametrize("patch", PATCHES, ids=[p.where for p in PATCHES])
def test_every_attribute_a_cuda_test_patches_exists(patch, monkeypatch):
    assert missing(patch, monkeypatch) is None


def test_the_parser_sees_the_cuda_tests_patches():
    """The known patches are found: a parser gone blind would pass the check above vacuously."""
    where = {p.where.split(":")[0] + p.where.split(" ")[1] for p in PATCHES}
    assert "kernels/test_backends.py(test_cuda_forced_small_parameter_layout)" in where
    # a CPU test's patch is none of them (test_torch_autocast patches torch.compiler on the CPU)
    assert not any("test_torch_autocast.py" in place for place in where)


_MOVED = '''
import pytest
from amp.kernels import _torch_backend
from helpers import DEVICES

@pytest.fixture
def cupy_backend():
    return None

@pytest.mark.cuda
def test_layout(cupy_backend, monkeypatch):
    monkeypatch.setattr(cupy_backend, "_devices", {})  # before the move to _cupy_device._gpus
    monkeypatch.setattr(cupy_backend.cuda, "_gpus", {})
    monkeypatch.setattr("amp.kernels._torch_backend.no_such_name", None)
    monkeypatch.setattr(_torch_backend, "optional", None, raising=False)

@pytest.mark.parametrize("device", DEVICES)
def test_device(device, monkeypatch):
    monkeypatch.setattr(_torch_backend, "gone", None)
    monkeypatch.setattr(local_module, "name", None)

def test_cpu(monkeypatch):
    monkeypatch.setattr(_torch_backend, "not_a_cuda_test", None)
'''


def test_a_moved_attribute_is_reported_with_where_the_test_patches_it(monkeypatch):
    found = cuda_tests.patches_in(_MOVED, "kernels/test_moved.py")
    problems = [missing(patch, monkeypatch) for patch in found]
    assert [p.name for p in found] == [
        "_devices",
        "_gpus",
        "amp.kernels._torch_backend.no_such_name",
        "gone",  # CUDA through helpers.DEVICES
        "name",
    ]  # raising=False and the CPU test are left out
    assert problems[0] == (
        "kernels/test_moved.py:12 (test_layout): cupy_backend has no attribute '_devices'"
    )
    assert problems[1] is None
    assert "'amp.kernels._torch_backend.no_such_name' does not resolve" in problems[2]
    assert problems[3].endswith("_torch_backend has no attribute 'gone'")
    assert "`local_module` is neither imported at the file's top nor in STAND_INS" in problems[4]
