"""Optimizer wrappers: the duck-typed check that lets objects wrapping a torch optimizer (apex's
LARC) through amp.initialize and scale_loss, and the torch optimizers such a wrapper holds."""

import torch

__all__ = [
    "OPTIMIZER_ATTRIBUTES",
    "is_optimizer_like",
    "require_optimizer_like",
    "wrapped_optimizers",
]

# What amp calls on an optimizer, or reads from it. apex's LARC has all of them, and
# add_param_group too (optional: amp patches it only where it exists).
OPTIMIZER_ATTRIBUTES = (
    "param_groups",
    "state",
    "step",
    "zero_grad",
    "state_dict",
    "load_state_dict",
)


def is_optimizer_like(obj):
    """A torch optimizer, or an object that wraps one and offers what amp calls on it."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    return hasattr(obj, "__dict__") and all(hasattr(obj, name) for name in OPTIMIZER_ATTRIBUTES)


def require_optimizer_like(obj, where):
    """Raise a TypeError naming what `obj` lacks if amp cannot instrument it as an optimizer."""
    if isinstance(obj, torch.optim.Optimizer):
        return
    kind = type(obj).__name__
    missing = [name for name in OPTIMIZER_ATTRIBUTES if not hasattr(obj, name)]
    if missing:
        raise TypeError(
            f"{where} is a {kind}, which is neither a torch.optim.Optimizer nor an optimizer "
            f"wrapper: it has no {', '.join(missing)}. amp accepts a torch.optim.Optimizer, or an "
            "object wrapping one that has param_groups, state, step, zero_grad, state_dict and "
            "load_state_dict (as apex's LARC has)."
        )
    not_callable = [
        name for name in OPTIMIZER_ATTRIBUTES[2:] if not callable(getattr(obj, name, None))
    ]
    if not_callable:
        raise TypeError(f"{where} is a {kind} whose {', '.join(not_callable)} is not callable.")
    if not hasattr(obj, "__dict__"):
        raise TypeError(
            f"{where} is a {kind} without an instance __dict__ (it uses __slots__): amp sets "
            "its step, zero_grad and state-dict methods on the optimizer instance. Give the "
            "wrapper a __dict__, or pass the torch optimizer it wraps."
        )
    groups = obj.param_groups
    if not isinstance(groups, list) or not all(
        isinstance(group, dict) and "params" in group for group in groups
    ):
        raise TypeError(
            f"{where} is a {kind} whose param_groups is not a list of dicts with 'params' "
            f"(got {type(groups).__name__}); it must expose the wrapped optimizer's param_groups."
        )


def wrapped_optimizers(obj):
    """The torch optimizers an optimizer wrapper holds as attributes (LARC's `optim`)."""
    if isinstance(obj, torch.optim.Optimizer) or not hasattr(obj, "__dict__"):
        return []
    return [value for value in vars(obj).values() if isinstance(value, torch.optim.Optimizer)]
