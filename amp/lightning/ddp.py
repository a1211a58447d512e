"""The Trainer's DistributedDataParallel, built again around the model amp cast.

Under DDP the Trainer wraps the model before the plugin's `connect`, where amp.initialize casts
it; a wrapper built for the FP32 parameters keeps buckets of their old dtype and would reduce
nothing once amp has cast them (each rank training on alone). (Fabric's wrappers are made again in
fabric.py's `setup`.)
"""

from typing import Any

import torch

__all__ = ["wrap_again"]


def wrap_again(
    strategy: Any, module: torch.nn.Module
) -> torch.nn.parallel.DistributedDataParallel:
    """DistributedDataParallel built again around the cast module, as the strategy builds it."""
    if not hasattr(strategy, "configure_ddp"):
        raise RuntimeError(
            f"AmpPrecision: {type(strategy).__name__} wrapped the model in "
            "DistributedDataParallel before amp.initialize could cast it, and AmpPrecision can "
            "rebuild the wrapper only for Lightning's DDPStrategy."
        )
    strategy.model = module
    strategy.configure_ddp()
    return strategy.model
