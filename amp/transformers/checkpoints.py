"""amp's state in the Trainer's checkpoints, and FP32 configs beside the FP32 weights.

A checkpoint gets ``amp_state.pt`` beside the Trainer's ``scaler.pt``: ``amp.state_dict()`` (the
loss scalers, plain Python values) and the count of skipped steps. O2's FP32 master weights travel
in ``optimizer.pt`` (amp's optimizer state dict carries them) and ``model.safetensors`` holds FP32
values at every level (amp's state-dict hooks), so a resumed run continues bit for bit.
"""

import os
import warnings
from typing import Any, Dict, Optional

import torch

import amp

__all__ = ["AMP_STATE_NAME", "fp32_config", "load_amp_state", "restore_amp_state", "save_amp_state"]

AMP_STATE_NAME = "amp_state.pt"


def save_amp_state(output_dir: str, skipped_steps: int) -> None:
    """Write ``amp.state_dict()`` and `skipped_steps` to `output_dir`/amp_state.pt."""
    state = {"amp": dict(amp.state_dict()), "skipped_steps": int(skipped_steps)}
    torch.save(state, os.path.join(output_dir, AMP_STATE_NAME))


def load_amp_state(checkpoint: str) -> Optional[Dict[str, Any]]:
    """What `save_amp_state` wrote to `checkpoint`; None, with a warning, where it wrote nothing
    (a checkpoint of transformers.Trainer: the loss scale then starts again)."""
    path = os.path.join(checkpoint, AMP_STATE_NAME)
    if not os.path.isfile(path):
        warnings.warn(
            f"AmpTrainer: the checkpoint {checkpoint} has no {AMP_STATE_NAME} (it was not saved by "
            "AmpTrainer), so amp's loss scale starts again from its initial value.",
            stacklevel=2,
        )
        return None
    state = torch.load(path, weights_only=True)
    if not isinstance(state, dict) or "amp" not in state:
        raise ValueError(
            f"AmpTrainer: {path} holds {type(state).__name__} "
            f"{sorted(state) if isinstance(state, dict) else ''}; expected a dict with 'amp' "
            "(amp.state_dict()) and 'skipped_steps', as AmpTrainer saves it."
        )
    return state


def restore_amp_state(state: Dict[str, Any]) -> int:
    """Load `state` (from `load_amp_state`) into amp; returns the skipped steps it counted."""
    amp.load_state_dict(state["amp"])
    return int(state.get("skipped_steps", 0))


def fp32_config(model: torch.nn.Module, output_dir: str) -> None:
    """Write `model`'s config to `output_dir` with ``dtype`` float32, the weights' dtype there.

    ``save_pretrained`` records ``model.dtype`` (its first parameter's: bfloat16 at O2/O3) as the
    config's dtype, and ``from_pretrained`` (``dtype="auto"``) would load the FP32 file in it.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    recorded = getattr(config, "dtype", None)
    config.dtype = torch.float32
    try:
        config.save_pretrained(output_dir)
    finally:
        config.dtype = recorded
