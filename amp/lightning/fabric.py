"""Fabric: `amp.lightning.setup(fabric, model, *optimizers)` in place of `fabric.setup(...)`.

Fabric gives a precision plugin the model (`convert_module`) but never its optimizers, and
amp.initialize needs both at once, on the model's device and before DDP wraps it. `setup` moves
the model to Fabric's device, runs the plugin's amp.initialize, then `fabric.setup` as usual. A
model set up after others (a GAN's generator, then its discriminator) joins them: amp.initialize
runs again with all of them, and the DDP wrappers Fabric made around the earlier ones are made
again around their cast parameters.
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

    Models set up one after another, each with its optimizers, as Lightning's DCGAN example
    does, are set up together: each later call runs amp.initialize again with all of them (amp
    takes every model at once), amp's state kept::

        generator, g_opt = amp.lightning.setup(fabric, generator, g_opt)
        discriminator, d_opt = amp.lightning.setup(fabric, discriminator, d_opt)
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
    earlier = (list(precision._models), list(precision._optimizers))
    precision.initialize(module, list(optimizers))  # with the earlier models again, if any
    try:
        _wrap_again(fabric, precision)
        result = fabric.setup(
            module, *optimizers, scheduler=scheduler, move_to_device=move_to_device
        )
    except BaseException:
        if earlier[0]:
            precision._set_up_again(*earlier)
            _wrap_again(fabric, precision)
        else:
            precision.teardown()
        raise
    wrapped = result[0] if isinstance(result, tuple) else result
    for optimizer in result[1 : 1 + len(optimizers)] if optimizers else ():
        flavours.route_to_instance(optimizer)  # its zero_grad() must be amp's
    precision._fabric_modules.append(wrapped)
    inner = getattr(wrapped, "_forward_module", None)  # the DDP wrapper, if Fabric made one
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        precision._ddps.append(inner)
    return result


def _wrap_again(fabric: Any, precision: Any) -> None:
    """The DDP wrappers Fabric made around models set up earlier, made again around them as amp
    cast them again (DDP keeps the gradient hooks of the parameters as they were when it was
    built, which a cast and its undo replace)."""
    precision._ddps = []
    for wrapped in precision._fabric_modules:
        if isinstance(wrapped._forward_module, torch.nn.parallel.DistributedDataParallel):
            wrapped._forward_module = fabric.strategy.setup_module(wrapped._original_module)
            precision._ddps.append(wrapped._forward_module)
