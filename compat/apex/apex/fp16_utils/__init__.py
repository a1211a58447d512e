"""apex.fp16_utils: `to_python_float`; apex's manual FP16 tools (before amp) are importable but
raise when called, naming what replaces them."""

from .._not_provided import not_provided


def to_python_float(t):
    """A one-element tensor's value as a Python number (anything else is returned as it is)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


_O2 = "amp.initialize(model, optimizer, opt_level='O2'), which keeps FP32 master weights"
_REPLACED = {
    "FP16_Optimizer": _O2,
    "FP16Model": "amp.initialize(model, opt_level='O2') or 'O3'",
    "network_to_half": "amp.initialize(model, opt_level='O2') or 'O3'",
    "convert_network": "amp.initialize(model, opt_level='O2') (BatchNorm stays FP32)",
    "convert_module": "amp.initialize(model, opt_level='O2') or 'O3'",
    "BN_convert_float": "amp.initialize(..., keep_batchnorm_fp32=True)",
    "tofp16": "amp.initialize(model, opt_level='O3')",
    "prep_param_lists": _O2,
    "model_grads_to_master_grads": _O2,
    "master_params_to_model_params": _O2,
    "clip_grad_norm": "torch.nn.utils.clip_grad_norm_ on amp.master_params(optimizer)",
    "LossScaler": "amp.scale_loss (a static scale: amp.initialize(..., loss_scale=128.0))",
    "DynamicLossScaler": "amp.scale_loss (dynamic loss scaling is the default at O1 and O2)",
}
globals().update(
    {name: not_provided(f"apex.fp16_utils.{name}", use) for name, use in _REPLACED.items()}
)

__all__ = ["to_python_float", *_REPLACED]
