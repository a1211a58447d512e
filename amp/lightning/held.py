"""Gradients a backward left scaled for an optimizer's step to unscale.

With several optimizers and none named for a backward (manual optimization, Fabric), the plugin
cannot tie the backward to one: the gradients stay scaled, held by the optimizers whose
parameters require gradients, and each optimizer's step (or the clipping before it) unscales and
checks its own, so an inf in one model's gradients skips its optimizer's step only.
"""

from typing import Any, Dict, List, Tuple

import torch

import amp

__all__ = ["HeldGradients"]


class HeldGradients:
    """id(optimizer) -> (loss_id, losses): the losses whose gradients an optimizer holds scaled."""

    def __init__(self) -> None:
        self._held: Dict[int, Tuple[int, List[torch.Tensor]]] = {}

    def holders(self, optimizers: List[Any]) -> List[Any]:
        """The optimizers an untied backward leaves its gradients to: those whose parameters
        require gradients (``toggle_optimizer`` leaves one), else all. Losses held by one whose
        gradients a zero_grad() dropped are dropped with them."""
        holders = [o for o in optimizers if _requires_grad(o)] or optimizers
        for optimizer in holders:
            if not _holds_scaled(optimizer):
                self._held.pop(id(optimizer), None)
        return holders

    def hold(self, optimizers: List[Any], loss_id: int, loss: torch.Tensor) -> None:
        """Each of `optimizers` now holds gradients of `loss`, scaled by loss scaler `loss_id`."""
        for optimizer in optimizers:
            losses = self._held.get(id(optimizer), (None, []))[1]
            self._held[id(optimizer)] = (loss_id, losses + [loss.detach()])

    def unscale(self, optimizer: Any) -> None:
        """Unscale and check the gradients `optimizer` holds scaled: an empty scale_loss block of
        the loss scaler that scaled them, whose losses it checks for inf/NaN; the optimizer's
        next step decides on it."""
        held = self._held.pop(id(optimizer), None)
        if held is None or not _holds_scaled(optimizer):
            return
        loss_id, losses = held
        loss = torch.stack([loss.float().sum() for loss in losses]).sum()  # non-finite if one is
        with amp.scale_loss(loss, optimizer, loss_id=loss_id):
            pass


def _requires_grad(optimizer: Any) -> bool:
    return any(p.requires_grad for group in optimizer.param_groups for p in group["params"])


def _holds_scaled(optimizer: Any) -> bool:
    """Whether `optimizer`'s gradients wait scaled to be unscaled (delay_unscale blocks since its
    last unscaling block; a zero_grad() drops them)."""
    record = getattr(optimizer, "__dict__", {}).get("_amp_record")
    return record is not None and record.stash.scaled_by is not None
