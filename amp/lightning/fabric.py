"""Fabric: `amp.lightning.setup(fabric, model, *optimizers)` in place of `fabric.setup(...)`.

Fabric gives a precision plugin the model (`convert_module`) but never its optimizers, and
amp.initialize needs both at once, on the model's device and before DDP wraps it. `setup` moves
the model to Fabric's device, runs the plugin's amp.initialize, then `fabric.setup` as usual.
"""

from typing import Any, Optional

import torch

__all__ = ["setup"]


def setup(
    fabric: Any,
    module: torch.nn.Module,
    *optimizers: torch.optim.Optimizer,
    scheduler: Optional[Any] = None,
    move_to_device: bool = True,
) -> Any:
    """Set up `module` and `optimizers` with amp and Fabric; returns what ``fabric.setup`` does.

    Example::

        fabric = Fabric(accelerator="cpu", plugins=[AmpPrecision(opt_level="O2")])
        model, optimizer = amp.lightning.setup(fabric, model, optimizer)
        ...
        fabric.backward(loss)        # through amp.scale_loss
        optimizer.step()             # skipped after a gradient overflow
        fabric.save(path, {"model": model, "optimizer": optimizer, "amp": precision})
    """
    from . import flavours
    from .plugin import AmpPrecisionBehaviour

    precision = fabric.strategy.precision
    if not isinstance(precision, AmpPrecisionBehaviour):
        raise TypeError(
            "amp.lightning.setup: this Fabric's precision plugin is "
            f"{type(precision).__name__}, not AmpPrecision; make it with "
            "Fabric(plugins=[AmpPrecision(...)])."
        )
    if move_to_device:
        module = fabric.to_device(module)
    precision.initialize(module, list(optimizers))
    try:
        result = fabric.setup(
            module, *optimizers, scheduler=scheduler, move_to_device=move_to_device
        )
    except BaseException:
        precision.teardown()
        raise
    wrapped = result[0] if isinstance(result, tuple) else result
    for optimizer in result[1 : 1 + len(optimizers)] if optimizers else ():
        flavours.route_to_instance(optimizer)  # its zero_grad() must be amp's
    inner = getattr(wrapped, "_forward_module", None)  # the DDP wrapper, if Fabric made one
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        precision._ddp = inner
    return result
