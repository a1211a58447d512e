"""The `apex` distribution backed by amp (compat/apex): apex.amp is amp, the installed metadata,
never shadowing another apex silently, and the names it does not provide."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import apex
import pytest
import torch

import amp
from helpers import ROOT


def test_apex_amp_is_the_amp_module_with_its_state():
    from apex import amp as from_apex
    import apex.amp as apex_amp
    from apex.amp import _amp_state
    from apex.amp._amp_state import _amp_state as state, master_params
    from apex.amp.amp import register_half_function
    from apex.amp.frontend import initialize, load_state_dict, state_dict
    from apex.amp.handle import disable_casts, scale_loss

    assert from_apex is amp and apex_amp is amp and apex.amp is amp
    assert _amp_state is state is amp._amp_state
    assert (initialize, state_dict, load_state_dict) == (
        amp.initialize,
        amp.state_dict,
        amp.load_state_dict,
    )
    assert (scale_loss, disable_casts, master_params, register_half_function) == (
        amp.scale_loss,
        amp.disable_casts,
        amp.master_params,
        amp.register_half_function,
    )
    assert amp._amp_state is state  # importing apex.amp._amp_state did not replace it


@pytest.mark.parametrize("name", ["scaler", "casting", "frontend_typo"])
def test_other_apex_amp_modules_raise_and_never_load_a_second_amp(name):
    with pytest.raises(ModuleNotFoundError, match=r"apex\.amp\._amp_state, apex\.amp\.frontend"):
        importlib.import_module(f"apex.amp.{name}")
    loaded = {key for key in sys.modules if key.startswith("apex.amp.")}
    assert loaded == {f"apex.amp.{module}" for module in apex._amp_alias.SUBMODULES}


def test_installed_metadata_is_visible_and_pins_this_amp():
    distribution = importlib.metadata.distribution("apex")
    assert distribution.version == f"{amp.__version__}+amp"
    assert f"amp=={amp.__version__}" in distribution.requires
    assert "backed by amp" in distribution.metadata["Summary"]
    # What Lightning (module_available("apex.amp")) and transformers (is_apex_available) check.
    assert importlib.util.find_spec("apex") is not None
    assert importlib.util.find_spec("apex.amp") is not None


def test_python_m_amp_reports_the_compat_package():
    result = subprocess.run([sys.executable, "-m", "amp"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    line = result.stdout.splitlines()[-1]
    assert line.startswith(f"apex compatibility package: installed (apex {amp.__version__}+amp at ")
    assert os.path.realpath(os.path.dirname(apex.__file__)) in line


def _fake_apex(root, with_amp):
    package = root / "apex"
    package.mkdir()
    (package / "__init__.py").write_text("")
    if with_amp:
        (package / "amp").mkdir()
        (package / "amp" / "__init__.py").write_text("")
    return package


@pytest.mark.parametrize("with_amp", [True, False])
def test_import_amp_says_when_an_apex_with_its_own_amp_would_be_imported(tmp_path, with_amp):
    package = _fake_apex(tmp_path, with_amp)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code = "import warnings; warnings.simplefilter('always'); import amp"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    warned = "an apex with its own apex.amp is importable" in result.stderr
    assert warned is with_amp, result.stderr
    if with_amp:
        assert str(package) in result.stderr and "pip install ./compat/apex" in result.stderr
    report = subprocess.run(
        [sys.executable, "-m", "amp"], capture_output=True, text=True, env=env
    ).stdout.splitlines()[-1]
    assert report.startswith("apex compatibility package: not installed; `import apex` gives")
    assert str(package) in report and ("with its own apex.amp" in report) is with_amp


def test_the_compat_package_says_when_it_shadows_another_apex(tmp_path, monkeypatch):
    package = _fake_apex(tmp_path, with_amp=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="shadows another apex package at") as warned:
        apex._shadowing.warn_about_other_apex(apex.__path__)
    assert str(package) in str(warned[0].message)
    assert "pip uninstall apex" in str(warned[0].message)


def test_importing_the_compat_package_alone_warns_nothing():
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import apex, amp; assert apex.amp is amp"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_names_not_provided_import_and_refuse_naming_the_replacement():
    names = {}
    exec("from apex.fp16_utils import *", names)  # as apex's imagenet example does
    from apex.fp16_utils import FP16_Optimizer, network_to_half
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.optimizers import FusedNovoGrad

    assert names["to_python_float"](torch.tensor([2.5])) == 2.5
    with pytest.raises(RuntimeError, match=r"FP16_Optimizer is not provided.*opt_level='O2'"):
        FP16_Optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))
    with pytest.raises(RuntimeError, match="network_to_half is not provided"):
        network_to_half(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="FusedNovoGrad is not provided"):
        FusedNovoGrad([torch.zeros(1, requires_grad=True)])
    assert multi_tensor_applier.available is False  # code that checks it takes its torch path
    with pytest.raises(RuntimeError, match=r"amp_C.*torch\._foreach_mul_"):
        multi_tensor_applier(print, torch.zeros(1, dtype=torch.int), [[torch.ones(2)]], 2.0)


def _not_provided_names():
    """apex.<module>.<Name> of every class the package refuses to create (apex._not_provided)."""
    import pkgutil

    found = set()
    for info in pkgutil.walk_packages(apex.__path__, "apex."):
        if info.name.split(".")[-1].startswith("_"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            init = getattr(value, "__init__", None)
            if isinstance(value, type) and "not_provided.<locals>" in getattr(
                init, "__qualname__", ""
            ):
                found.add(name)
    return found


def test_the_compat_readme_lists_every_refusal():
    readme = (ROOT / "compat" / "apex" / "README.md").read_text()
    refused = _not_provided_names()
    assert {"FP16_Optimizer", "FusedNovoGrad", "LossScaler"} <= refused
    missing = sorted(
        name for name in refused if f"`{name}`" not in readme and f".{name}`" not in readme
    )
    assert not missing, f"compat/apex/README.md does not list {missing}"
    assert "multi_tensor_applier" in readme
