"""The Lightning packages amp plugs into, found without importing them before they are needed.

Lightning 2 ships as two copies of the same code: ``lightning`` (``lightning.pytorch`` and
``lightning.fabric``) and ``pytorch_lightning`` (with ``lightning_fabric``); installing
``lightning`` installs both. Each Trainer and each Fabric accepts only plugins derived from its own
copy's ``Precision``, so ``AmpPrecision`` derives from every installed copy's, and each Trainer hook
that calls back into Lightning (callbacks, gradient clipping) runs the code of the copy that owns
the LightningModule being trained.
"""

import dataclasses
import functools
import importlib
import importlib.util
from typing import Any, Optional, Tuple

import torch

__all__ = [
    "INSTALL_HINT",
    "Flavour",
    "installed",
    "of_module",
    "unwrap_optimizer",
    "route_to_instance",
    "lightning_optimizers",
    "build_class",
]

# (package of the Trainer, package of Fabric), the unified package first.
_PACKAGES = (("lightning.pytorch", "lightning.fabric"), ("pytorch_lightning", "lightning_fabric"))

INSTALL_HINT = (
    "amp.lightning needs Lightning 2: pip install 'amp[lightning]' (or pip install lightning, "
    "after your torch build)"
)


@dataclasses.dataclass(frozen=True)
class Flavour:
    """One installed copy of Lightning: the classes amp's plugin derives from or meets."""

    name: str
    precision: type  # the Precision class AmpPrecision derives from (the Trainer's, if present)
    lightning_module: Optional[type]  # None for a Fabric-only install (lightning_fabric alone)
    optimizer_wrappers: Tuple[type, ...]  # LightningOptimizer, _FabricOptimizer: `._optimizer`
    lightning_optimizer: Optional[type] = None  # what `LightningModule.optimizers()` returns


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def _load(trainer_package: str, fabric_package: str) -> Optional[Flavour]:
    wrappers = []
    if _installed(fabric_package):
        wrappers.append(importlib.import_module(f"{fabric_package}.wrappers")._FabricOptimizer)
    if _installed(trainer_package):
        package = importlib.import_module(trainer_package)
        lightning_optimizer = importlib.import_module(
            f"{trainer_package}.core.optimizer"
        ).LightningOptimizer
        wrappers.append(lightning_optimizer)
        return Flavour(
            trainer_package,
            package.plugins.Precision,
            package.LightningModule,
            tuple(wrappers),
            lightning_optimizer,
        )
    if wrappers:
        fabric = importlib.import_module(fabric_package)
        return Flavour(fabric_package, fabric.plugins.Precision, None, tuple(wrappers))
    return None


@functools.lru_cache(maxsize=None)
def installed() -> Tuple[Flavour, ...]:
    """Every installed copy of Lightning 2, imported on the first call."""
    found = tuple(flavour for packages in _PACKAGES if (flavour := _load(*packages)) is not None)
    if not found:
        raise ImportError(INSTALL_HINT)
    return found


def of_module(module: torch.nn.Module) -> Flavour:
    """The copy of Lightning whose LightningModule `module` is (the Trainer hands us one)."""
    for flavour in installed():
        if flavour.lightning_module is not None and isinstance(module, flavour.lightning_module):
            return flavour
    raise TypeError(
        f"AmpPrecision.connect: expected a LightningModule, got {type(module).__name__}."
    )


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's LightningOptimizer or Fabric's _FabricOptimizer."""
    wrappers = tuple(w for flavour in installed() for w in flavour.optimizer_wrappers)
    while isinstance(optimizer, wrappers):
        optimizer = optimizer._optimizer
    return optimizer


# The optimizer methods that must run on the optimizer itself. Lightning's optimizer wrappers
# subclass the optimizer's class on the fly and reach the optimizer's attributes only where no
# class defines the name, so the class's methods run on the wrapper: zero_grad() would miss amp's
# (its gradients and pending overflow flags stay), and torch's load_state_dict() binds the loaded
# `state` and `param_groups` on the wrapper, leaving the optimizer amp steps as it was (a resumed
# run started from fresh Adam moments while the checkpoint's sat on the LightningOptimizer).
_INSTANCE_METHODS = ("zero_grad", "state_dict", "load_state_dict", "add_param_group")


def route_to_instance(wrapper: Any) -> Any:
    """Make `wrapper` (a LightningOptimizer or _FabricOptimizer) call these methods of its
    optimizer (amp's where amp replaced them, else the optimizer's own, torch's state-dict hooks
    and all), where the wrapper class does not define the method itself."""
    optimizer = unwrap_optimizer(wrapper)
    wrappers = tuple(w for flavour in installed() for w in flavour.optimizer_wrappers)
    defined = {name for cls in type(wrapper).__mro__ if cls in wrappers for name in vars(cls)}
    for name in _INSTANCE_METHODS:
        method = getattr(optimizer, name, None)
        if method is not None and name not in defined:
            setattr(wrapper, name, method)
    return wrapper


def lightning_optimizers(flavour: Flavour, optimizers: list) -> list:
    """LightningOptimizers around amp's optimizers that call amp's methods of each instance (the
    Trainer keeps a LightningOptimizer handed to it, as from ``configure_optimizers``)."""
    return [
        route_to_instance(flavour.lightning_optimizer(unwrap_optimizer(optimizer)))
        for optimizer in optimizers
    ]


def build_class(behaviour: type) -> type:
    """AmpPrecision: `behaviour` first, then every installed copy's Precision class."""
    bases = tuple(flavour.precision for flavour in installed())
    return type(
        "AmpPrecision",
        (behaviour, *bases),
        {
            "__module__": "amp.lightning",
            "__qualname__": "AmpPrecision",
            "__doc__": behaviour.__doc__,
        },
    )
