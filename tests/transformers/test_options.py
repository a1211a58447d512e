"""amp_options (amp/transformers/options.py): completed into amp.initialize's arguments, and
refused with what was wrong where amp.initialize would not take it."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5")  # the `transformers` extra (make test)

from amp.transformers.options import initialize_kwargs  # noqa: E402


def test_defaults_are_o2_bfloat16_and_the_rest_passes_through():
    assert initialize_kwargs(None) == {"opt_level": "O2", "dtype": torch.bfloat16}
    options = {"opt_level": "O2", "fp32_modules": ["lm_head"], "loss_scale": 128.0}
    assert initialize_kwargs(options) == {**options, "dtype": torch.bfloat16}


def test_o1_returns_fp32_outputs_as_the_trainers_own_mixed_precision_does():
    assert initialize_kwargs({"opt_level": "O1"})["cast_model_outputs"] is torch.float32
    kept = initialize_kwargs({"opt_level": "O1", "cast_model_outputs": torch.float16})
    assert kept["cast_model_outputs"] is torch.float16


@pytest.mark.parametrize(
    "options,error,words",
    [
        ({"opt_level": "00"}, ValueError, "opt_level '00'; expected one of O0, O1, O2, O3"),
        ({"dtype": torch.float32}, ValueError, "dtype torch.float32; expected torch.float16"),
        ({"learning_rate": 1e-3}, TypeError, "['learning_rate'] are not arguments of amp.init"),
        ({"enabled": False}, TypeError, "may not contain enabled: for a run without amp"),
        ({"optimizers": []}, TypeError, "may not contain optimizers"),
        ("O2", TypeError, "amp_options must be a dict of amp.initialize arguments"),
    ],
)
def test_what_amp_initialize_would_not_take_is_refused(options, error, words):
    with pytest.raises(error) as raised:
        initialize_kwargs(options)
    assert words in str(raised.value)
