"""O2's deferred master gradients (the CuPy kernels with amp's fused step to come): scale_loss's
exit only checks the model's low-precision gradients and keeps them, still scaled, until the step,
which unscales them as it reads them; no FP32 master gradient is made.

One `Deferral` per optimizer owns that state: what is kept (`Deferred`), the class the masters
wear meanwhile, and the two ways it ends: `take` (the step used them, a skip or zero_grad dropped
them) and `materialize` (something needs FP32 master gradients). A read, write or delete of a
master's `.grad` while they are kept (clip_grad_norm_ over optimizer.param_groups, a gradient
log, a list of amp.master_params kept from earlier) materializes them first, so that it sees and
changes what the general path's step would use.
"""

import torch

from .. import kernels
from .columns import consume, repeat

__all__ = ["Deferred", "Deferral"]

_TENSOR_GRAD = torch.Tensor.grad  # the C-level attribute, under a deferring master's property


class Deferred:
    """The masters' gradients kept in low precision until the step."""

    __slots__ = ("models", "masters", "grads", "inv_scale", "flags", "by_master")

    def __init__(self, models, masters, grads, inv_scale, flags):
        self.models, self.masters, self.grads = models, masters, grads
        self.inv_scale = inv_scale  # 1/scale the gradients were scaled with (never written)
        self.flags = flags  # kernels.check_'s: which of them held inf/NaN, asked on a skip
        self.by_master = dict(zip(map(id, masters), grads))

    def grads_of(self, masters):
        return list(map(self.by_master.get, map(id, masters)))

    def nonfinite_models(self):
        """The model parameters whose gradients held inf/NaN (reads the device)."""
        return [self.models[i] for i in self.flags.tensors()]


class Deferral:
    """The deferred master gradients of one optimizer: `kept` is a Deferred while there are."""

    def __init__(self, base=torch.nn.Parameter):
        self.kept = None
        self.base = base  # the masters' own class (masters.HollowMaster for compact ones)
        self._class = _deferring_class(self, base)

    def defer(self, models, masters, grads, inv_scale, found_inf):
        """scale_loss's exit: check the gradients (found_inf) and keep them with the inverse
        scale they were scaled with (no update writes it: scaling/scaler.py)."""
        flags = kernels.check_(grads, found_inf)
        self.kept = Deferred(models, masters, grads, inv_scale, flags)
        consume(map(setattr, masters, repeat("__class__"), repeat(self._class)))

    def take(self):
        """The kept gradients, no longer kept (the step uses them, or they are dropped): the
        masters are plain Parameters again."""
        kept, self.kept = self.kept, None
        if kept is not None:
            consume(map(setattr, kept.masters, repeat("__class__"), repeat(self.base)))
        return kept

    def materialize(self):
        """The kept gradients as FP32 master gradients, unscaled as scale_loss's exit would have
        made them (the general path, a read of a master's `.grad`, a next scale_loss block)."""
        kept = self.take()
        fresh = list(map(torch.empty_like, kept.masters))
        scratch = torch.zeros((), dtype=torch.float32, device=kept.inv_scale.device)
        kernels.unscale_to_(kept.grads, fresh, kept.inv_scale, scratch, check=False)
        consume(map(setattr, kept.masters, repeat("grad"), fresh))


def _deferring_class(deferral, base):
    """The class a master wears while its gradient is kept (one per optimizer, a subclass of the
    masters' own `base`): any access to its `.grad` materializes the kept gradients first."""

    def made(param):
        if deferral.kept is not None:
            deferral.materialize()
        return param

    grad = property(
        lambda param: _TENSOR_GRAD.__get__(made(param)),
        lambda param, value: _TENSOR_GRAD.__set__(made(param), value),
        lambda param: _TENSOR_GRAD.__delete__(made(param)),
        doc=_TENSOR_GRAD.__doc__,
    )
    def deepcopy(param, memo):
        """A copy of a master made while its gradient is kept is of the masters' own class (this
        one belongs to the optimizer's deferral, not to the copy)."""
        copied = base.__deepcopy__(param, memo)
        copied.__class__ = base
        return copied

    return type("DeferredGradParameter", (base,), {"grad": grad, "__deepcopy__": deepcopy})
