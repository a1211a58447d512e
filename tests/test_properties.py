import dataclasses

import pytest
import torch

from amp import properties

# apex.amp's property table (apex/amp/frontend.py), with float16 as the low-precision type.
APEX_TABLE = {
    "O0": (torch.float32, False, None, False, 1.0),
    "O1": (None, True, None, None, "dynamic"),
    "O2": (torch.float16, False, True, True, "dynamic"),
    "O3": (torch.float16, False, False, False, 1.0),
}
FIELDS = (
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
)


@pytest.mark.parametrize("opt_level", sorted(APEX_TABLE))
def test_defaults_are_apex_table(opt_level):
    defaults = properties.defaults(opt_level)
    assert defaults.enabled is True
    assert defaults.opt_level == opt_level
    assert tuple(getattr(defaults, name) for name in FIELDS) == APEX_TABLE[opt_level]
    assert defaults.dtype is torch.float16


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_bfloat16_is_the_model_type_of_o2_o3(opt_level):
    assert properties.defaults(opt_level, torch.bfloat16).cast_model_type is torch.bfloat16


def test_briefs_are_apex_strings():
    assert properties.OPT_LEVELS["O0"].describe() == "O0:  Pure FP32 training.\n"
    assert properties.OPT_LEVELS["O3"].describe() == "O3:  Pure FP16 training."


@pytest.mark.parametrize(
    "opt_level, line",
    [
        ("O0", "O0:  Pure FP32 training.\n"),
        ("O1", "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n"),
        ("O2", "O2:  BF16 training with FP32 batchnorm and FP32 master weights.\n"),
        ("O3", "O3:  Pure BF16 training."),
    ],
)
def test_briefs_name_the_dtype_in_use(opt_level, line):
    assert properties.OPT_LEVELS[opt_level].describe(torch.bfloat16) == line


@pytest.mark.parametrize("bad", ["o1", "01", "O4", "", 1, None])
def test_unknown_opt_level_says_letter_o(bad):
    with pytest.raises(RuntimeError, match="the prefix O is the letter O, not the number zero"):
        properties.resolve(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, "float16"])
def test_dtype_must_be_low_precision(dtype):
    with pytest.raises(ValueError, match="torch.float16 or torch.bfloat16"):
        properties.resolve("O2", dtype=dtype)


def test_none_dtype_means_float16():
    _, resolved = properties.resolve("O2", dtype=None)
    assert resolved.dtype is torch.float16 and resolved.cast_model_type is torch.float16


@pytest.mark.parametrize("value", [torch.float16, torch.bfloat16, torch.float64])
def test_o1_refuses_cast_model_type(value):
    with pytest.raises(RuntimeError, match="O1 inserts casts around Torch functions"):
        properties.resolve("O1", cast_model_type=value)


@pytest.mark.parametrize("value", [False, torch.float32])
def test_o1_accepts_harmless_cast_model_type(value):
    _, resolved = properties.resolve("O1", cast_model_type=value)
    assert resolved.cast_model_type is value


@pytest.mark.parametrize("value", [torch.int32, torch.float64, "fp16"])
def test_cast_model_type_must_be_float_type(value):
    with pytest.raises(ValueError, match="cast_model_type"):
        properties.resolve("O2", cast_model_type=value)


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_patch_torch_functions_only_with_o1(opt_level):
    with pytest.raises(RuntimeError, match="should only be set by selecting opt_level='O1'"):
        properties.resolve(opt_level, patch_torch_functions=True)
    _, resolved = properties.resolve(opt_level, patch_torch_functions=False)
    assert resolved.patch_torch_functions is False


def test_o1_can_turn_patching_off():
    _, resolved = properties.resolve("O1", patch_torch_functions="False")
    assert resolved.patch_torch_functions is False


@pytest.mark.parametrize("value", [True, False, "True", "False"])
def test_o1_refuses_keep_batchnorm_fp32(value):
    with pytest.raises(RuntimeError, match="keep_batchnorm_fp32 should be None"):
        properties.resolve("O1", keep_batchnorm_fp32=value)


@pytest.mark.parametrize(
    "value,expected", [("True", True), ("False", False), (True, True), (False, False)]
)
def test_keep_batchnorm_fp32_string_forms(value, expected):
    _, resolved = properties.resolve("O2", keep_batchnorm_fp32=value)
    assert resolved.keep_batchnorm_fp32 is expected


@pytest.mark.parametrize("value", ["true", 1, 0.0, "yes"])
def test_keep_batchnorm_fp32_rejects_other_values(value):
    with pytest.raises(
        ValueError,
        match="keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None",
    ):
        properties.resolve("O2", keep_batchnorm_fp32=value)


@pytest.mark.parametrize("value", [True, False])
def test_o1_refuses_master_weights(value):
    with pytest.raises(RuntimeError, match="doesn't make sense to use master_weights with O1"):
        properties.resolve("O1", master_weights=value)


def test_master_weights_override():
    _, resolved = properties.resolve("O3", master_weights=True)
    assert resolved.master_weights is True
    with pytest.raises(TypeError, match="master_weights must be"):
        properties.resolve("O2", master_weights="yes")


@pytest.mark.parametrize(
    "value,expected", [("dynamic", "dynamic"), ("128.0", 128.0), (128, 128.0), (0.5, 0.5)]
)
def test_loss_scale_forms(value, expected):
    _, resolved = properties.resolve("O1", loss_scale=value)
    assert resolved.loss_scale == expected
    assert type(resolved.loss_scale) is type(expected)


@pytest.mark.parametrize("value", ["big", float("inf"), float("nan"), 0, -1.0, True, [1.0]])
def test_loss_scale_rejects_nonsense(value):
    with pytest.raises((ValueError, TypeError), match="loss_scale"):
        properties.resolve("O1", loss_scale=value)


def test_overrides_leave_the_rest_of_the_level():
    base, resolved = properties.resolve("O2", loss_scale=64.0, keep_batchnorm_fp32=False)
    assert base.loss_scale == "dynamic" and base.keep_batchnorm_fp32 is True
    assert resolved.loss_scale == 64.0 and resolved.keep_batchnorm_fp32 is False
    assert resolved.master_weights is True and resolved.cast_model_type is torch.float16


def test_properties_are_frozen():
    resolved = properties.defaults("O1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.loss_scale = 1.0


def test_format_options_is_apex_dump():
    lines = properties.format_options(properties.defaults("O1")).splitlines()
    assert lines[0] == f"{'enabled':22} : True"
    assert lines[3] == f"{'patch_torch_functions':22} : True"
    assert [line.split()[0] for line in lines] == list(properties.OPTION_NAMES) + ["dtype"]


@pytest.mark.parametrize("name", ["enabled", "loss_scale_window"])
def test_only_the_overridable_options_are_taken(name):
    # enabled is initialize's own argument, never an override of a level
    with pytest.raises(TypeError, match="unknown amp option"):
        properties.resolve("O2", **{name: True})


@pytest.mark.parametrize("value", [0, 1, 2])
def test_verbosity_levels(value):
    assert properties.check_verbosity(value, "verbosity") == value


@pytest.mark.parametrize("value", [3, 7, -1, True, 1.0, "1"])
def test_verbosity_outside_the_levels_is_refused(value):
    with pytest.raises(ValueError, match="verbosity must be 0, 1 or 2"):
        properties.check_verbosity(value, "verbosity")
