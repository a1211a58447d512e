"""apex.parallel.DistributedDataParallel on torch's DistributedDataParallel, and apex's Reducer.

apex's arguments, by what they do to results:
- honoured: `gradient_average`, `gradient_predivide_factor` (and its old name
  `gradient_average_split_factor`) and `allreduce_always_fp32`, through a communication hook
  that runs apex's arithmetic (divide by the predivide factor, sum, multiply by
  factor / world size); `disable_allreduce()` / `enable_allreduce()`.
- accepted, no effect on results (when and in which buckets gradients are reduced):
  `message_size`, `delay_allreduce`, `allreduce_trigger_params`, `num_allreduce_streams`,
  `allreduce_communicators`, `prof`.
- refused: `shared_param` (apex refused it too) and `retain_allreduce_buffers=True` (apex kept
  its flat buffers for the caller to read; torch's buckets are not exposed).
Keyword arguments of torch's DistributedDataParallel (`find_unused_parameters`, ...) pass through.
torch's DDP refuses SyncBatchNorm layers in a CPU module; this one lets apex's SyncBatchNorm
through, which synchronises on CPU as well.

apex's flat helpers (`flat_dist_call`, `apply_flat_dist_call`, `flatten`, `unflatten`,
`split_by_type`) are importable from here, as from apex (see _flat.py).
"""

import torch
import torch.distributed as dist

from .._ignored import warn_ignored
from ._flat import apply_flat_dist_call, flat_dist_call, flatten, split_by_type, unflatten
from .sync_batchnorm import SyncBatchNorm

__all__ = [
    "DistributedDataParallel",
    "Reducer",
    "apply_flat_dist_call",
    "flat_dist_call",
    "flatten",
    "split_by_type",
    "unflatten",
]

# apex's defaults of the arguments accepted with no effect: a value other than these warns once.
_IGNORED_DEFAULTS = dict(
    message_size=10000000,
    delay_allreduce=False,
    allreduce_trigger_params=None,
    num_allreduce_streams=1,
    allreduce_communicators=None,
    prof=False,
)


class _Averaging:
    """What apex's arithmetic around the all-reduce needs: the state of `_apex_allreduce`."""

    def __init__(self, process_group, average, predivide_factor, always_fp32):
        self.process_group = process_group
        self.average = average
        self.predivide_factor = predivide_factor
        self.always_fp32 = always_fp32


def _apex_allreduce(state, bucket):
    """A DDP communication hook: divide by the predivide factor, sum over ranks (in float32
    with allreduce_always_fp32), multiply by factor / world size (when averaging)."""
    buffer = bucket.buffer()
    tensor = buffer.float() if state.always_fp32 and buffer.is_floating_point() else buffer
    if state.predivide_factor != 1.0:
        tensor.mul_(1.0 / state.predivide_factor)
    world_size = dist.get_world_size(state.process_group)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)

    def finish(future):
        reduced = future.value()[0]
        if state.average:
            reduced.mul_(state.predivide_factor / world_size)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return work.get_future().then(finish)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """apex's DistributedDataParallel: torch's, with apex's arguments (see the module docstring).

    Wrap the model after `amp.initialize`, as with apex.
    """

    def __init__(
        self,
        module,
        message_size=10000000,
        delay_allreduce=False,
        shared_param=None,
        allreduce_trigger_params=None,
        retain_allreduce_buffers=False,
        allreduce_always_fp32=False,
        num_allreduce_streams=1,
        allreduce_communicators=None,
        gradient_average=True,
        gradient_predivide_factor=1.0,
        gradient_average_split_factor=None,
        prof=False,
        **torch_kwargs,
    ):
        if shared_param is not None:
            raise ValueError(
                "apex.parallel.DistributedDataParallel: shared_param is not supported (apex "
                f"refused it too); got shared_param={shared_param!r}. Leave it out."
            )
        if retain_allreduce_buffers:
            raise ValueError(
                "apex.parallel.DistributedDataParallel: retain_allreduce_buffers=True is not "
                "supported: apex kept its flat all-reduce buffers for the caller, and torch's "
                "DDP buckets are not exposed. Leave it False and read the parameters' .grad."
            )
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError(
                "apex.parallel.DistributedDataParallel: allreduce_trigger_params is only valid "
                "with delay_allreduce=False (as in apex)."
            )
        warn_ignored(
            "apex.parallel.DistributedDataParallel",
            "it set when and in which buckets apex all-reduced; torch's DistributedDataParallel "
            "schedules its own buckets (bucket_cap_mb) and reduces to the same gradients",
            dict(
                message_size=message_size,
                delay_allreduce=delay_allreduce,
                allreduce_trigger_params=allreduce_trigger_params,
                num_allreduce_streams=num_allreduce_streams,
                allreduce_communicators=allreduce_communicators,
                prof=prof,
            ),
            _IGNORED_DEFAULTS,
        )
        if gradient_average_split_factor is not None:
            gradient_predivide_factor = gradient_average_split_factor
        if not float(gradient_predivide_factor) > 0:
            raise ValueError(
                "apex.parallel.DistributedDataParallel: gradient_predivide_factor must be "
                f"positive; got {gradient_predivide_factor!r}."
            )
        super().__init__(module, **torch_kwargs)
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        self.delay_allreduce = delay_allreduce
        self.message_size = message_size
        if (self.gradient_average, self.gradient_predivide_factor, self.allreduce_always_fp32) != (
            True,
            1.0,
            False,
        ):
            state = _Averaging(
                torch_kwargs.get("process_group"),
                self.gradient_average,
                self.gradient_predivide_factor,
                self.allreduce_always_fp32,
            )
            self.register_comm_hook(state, _apex_allreduce)

    def _passing_sync_batchnorm_handle(self, module):
        # torch refuses every SyncBatchNorm in a CPU module; apex's synchronises on CPU too.
        layers = [m for m in module.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
        if self.device_type != "cpu" or not all(isinstance(m, SyncBatchNorm) for m in layers):
            super()._passing_sync_batchnorm_handle(module)

    def disable_allreduce(self):
        """Stop reducing gradients (they accumulate locally) until enable_allreduce()."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self):
        self.require_backward_grad_sync = True


class Reducer:
    """apex's Reducer: `reduce()` all-reduces and averages the gradients of a module's
    parameters (or a list of gradients) over the default process group, when called."""

    def __init__(self, module_or_grads_list):
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module = module_or_grads_list
            for param in self.module.parameters():
                dist.broadcast(param.data, 0)
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self):
        if self.module is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        world_size = dist.get_world_size()
        for grad in grads:
            dist.all_reduce(grad)
            grad.div_(world_size)
