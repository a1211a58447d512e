"""The version check (amp/transformers/versions.py): AmpTrainer overrides private Trainer methods,
so it runs on the Transformers and Accelerate versions it was checked against and fails clearly on
others."""

import pytest

transformers = pytest.importorskip("transformers", minversion="5")  # the `transformers` extra

import accelerate  # noqa: E402

from amp.transformers import versions  # noqa: E402


def test_the_installed_versions_are_checked_ones():
    versions.check_versions(transformers.__version__, accelerate.__version__, transformers.Trainer)


def test_another_version_is_refused_naming_the_private_methods(monkeypatch):
    monkeypatch.delenv(versions.UNCHECKED_VARIABLE, raising=False)
    with pytest.raises(RuntimeError) as error:
        versions.check_versions("5.30.0", accelerate.__version__, transformers.Trainer)
    message = str(error.value)
    assert "not checked against transformers 5.30.0 (checked: 5.23.x, 5.24.x)" in message
    assert "_clip_grad_norm, _get_grad_norm, _save_scaler, _load_scaler" in message
    assert "AMP_TRANSFORMERS_UNCHECKED=1" in message
    with pytest.raises(RuntimeError, match=r"accelerate 1\.20\.0 \(checked: 1\.15\.x\)"):
        versions.check_versions(transformers.__version__, "1.20.0", transformers.Trainer)


def test_the_variable_turns_the_refusal_into_a_warning(monkeypatch):
    monkeypatch.setenv(versions.UNCHECKED_VARIABLE, "1")
    with pytest.warns(UserWarning, match="not checked against transformers 5.30.0"):
        versions.check_versions("5.30.0", accelerate.__version__, transformers.Trainer)


def test_a_trainer_whose_private_methods_changed_is_refused_even_so(monkeypatch):
    monkeypatch.setenv(versions.UNCHECKED_VARIABLE, "1")

    class Changed(transformers.Trainer):
        def _clip_grad_norm(self, model, max_norm):
            pass

    with pytest.raises(
        RuntimeError,
        match=r"_clip_grad_norm\(model\), but .* has "
        r"_clip_grad_norm\(model, max_norm\)",
    ):
        versions.check_versions(transformers.__version__, accelerate.__version__, Changed)
