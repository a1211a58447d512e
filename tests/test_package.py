"""The package surface: public names and their types, python -m amp, no CuPy or CUDA at import."""

import ast
import inspect
import pathlib
import subprocess
import sys

import pytest
import torch

import amp

AMP = pathlib.Path(amp.__file__).parent

API = {  # ../shared/API.md
    "initialize",
    "deinitialize",
    "scale_loss",
    "disable_casts",
    "master_params",
    "state_dict",
    "load_state_dict",
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "autocast",
    "custom_fwd",
    "custom_bwd",
    "GradScaler",
    "trace",
    "last_overflow",
    "NonFiniteLossWarning",
    "audit",
}


def test_all_is_the_api_and_importable():
    assert set(amp.__all__) == API
    assert all(hasattr(amp, name) for name in amp.__all__)
    assert isinstance(amp.__version__, str)


def _public_callables():
    """Every public function of amp, and every class with the methods it defines itself."""
    for name in sorted(amp.__all__):
        value = getattr(amp, name)
        if inspect.isclass(value) and issubclass(value, Warning):
            continue
        yield pytest.param(value, id=name)
        if inspect.isclass(value):
            for attribute, member in vars(value).items():
                if not attribute.startswith("_") and inspect.isfunction(member):
                    yield pytest.param(member, id=f"{name}.{attribute}")


@pytest.mark.parametrize("value", list(_public_callables()))
def test_public_api_is_annotated_and_documented(value):
    name = value.__qualname__
    signature = inspect.signature(value)
    unannotated = [
        parameter.name
        for parameter in signature.parameters.values()
        if parameter.annotation is inspect.Parameter.empty and parameter.name not in ("self", "cls")
    ]
    assert not unannotated, f"{name}: {unannotated} without a type"
    if not inspect.isclass(value):
        assert signature.return_annotation is not inspect.Signature.empty, name
    assert inspect.getdoc(value), f"{name} has no docstring"


def test_signatures_show_the_parameters():
    # both take torch's positional form too, which one signature cannot state
    assert list(inspect.signature(amp.autocast).parameters) == [
        "enabled",
        "dtype",
        "cache_enabled",
        "device_type",
        "float8",
    ]
    assert inspect.signature(amp.autocast).parameters["dtype"].default is torch.float16
    assert list(inspect.signature(amp.GradScaler).parameters) == [
        "device",
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "enabled",
    ]


def _bound_names(tree):
    """Names a module binds at its top level, and the public functions and classes it defines."""
    bound, defined = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if not node.name.startswith("_"):
                defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        else:
            bound.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
    return bound, defined


def _declared(tree):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return ast.literal_eval(node.value)
    return None


# Read, not imported: the CuPy modules import cupy, which CI does not install.
@pytest.mark.parametrize(
    "path", sorted(AMP.rglob("*.py")), ids=lambda path: str(path.relative_to(AMP.parent))
)
def test_every_module_declares_what_it_offers(path):
    tree = ast.parse(path.read_text())
    bound, defined = _bound_names(tree)
    declared = _declared(tree)
    if declared is None:
        assert not defined, f"{path.name} defines {sorted(defined)} and has no __all__"
        return
    if "__getattr__" not in bound:  # a module __getattr__ makes names on first use
        unbound = set(declared) - bound
        assert not unbound, f"{path.name}: __all__ names {sorted(unbound)}, which it does not bind"
    assert defined <= set(declared), f"{path.name}: {sorted(defined - set(declared))} undeclared"


def test_environment_report():
    result = subprocess.run([sys.executable, "-m", "amp"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"amp {amp.__version__}"
    assert any(line.startswith("torch ") for line in lines)
    assert any(line.startswith("wrapt ") for line in lines)
    assert any(line.startswith("cupy ") for line in lines)
    backend = [line for line in lines if line.startswith("kernel backend on CUDA tensors:")]
    assert backend and "(" in backend[0]  # which backend, and why
    assert any("op tables:" in line for line in lines)
    low_precision = [line for line in lines if line.startswith("low precision on cpu (")]
    assert low_precision and "float16" in low_precision[0]  # what the CPU does with it
    apex = [line for line in lines if line.startswith("apex compatibility package: ")]
    assert len(apex) == 1 and ("installed (" in apex[0] or "not installed" in apex[0])


def test_import_touches_neither_cupy_nor_cuda():
    code = (
        "import sys, torch\n"
        "torch.cuda.init = lambda: (_ for _ in ()).throw(AssertionError('CUDA touched'))\n"
        "import amp\n"
        "assert 'cupy' not in sys.modules\n"
        "print('clean')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "clean", result.stderr
