"""The optimizer step under amp: backward inside amp.scale_loss, clipping what the step uses, and
the watch that reports skipped steps and holds the LR scheduler after one.

The Trainer holds its LR scheduler after a step its own GradScaler skipped (transformers 5.24
trainer.py: ``if not self.accelerator.optimizer_step_was_skipped: self.lr_scheduler.step()``,
Accelerate's AcceleratedOptimizer reporting the skip); `SkipWatch` reports amp's skips the same way,
so AmpTrainer holds it too, with every optimizer. (The Trainer's own path misses the skip of a fused
AdamW, its default optimizer, which torch's GradScaler lets skip inside step(): there its scheduler
advances. tests/transformers/test_steps.py shows both.)
"""

import contextlib
from typing import Any, Iterator, List, Optional

import torch
from transformers import TrainerCallback

import amp

__all__ = ["SkipWatch", "clip_masters", "masters_grad_norm", "scaled_backward"]


@contextlib.contextmanager
def scaled_backward(accelerator: Any, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, ``accelerator.backward(loss)`` runs inside ``amp.scale_loss``.

    The Trainer's training_step keeps everything else its own: the loss normalised for gradient
    accumulation, DDP's no_sync, the logged loss. A micro-batch before the accumulation boundary
    (``accelerator.sync_gradients`` False) keeps its gradients scaled and the last one unscales
    them all (``delay_unscale``): one unscale and one overflow check per optimizer step.
    """
    backward = accelerator.backward  # the class's method, bound

    def amp_backward(loss: torch.Tensor, **kwargs: Any) -> None:
        delay = not accelerator.sync_gradients
        with amp.scale_loss(loss, optimizer, delay_unscale=delay) as scaled:
            backward(scaled, **kwargs)

    accelerator.backward = amp_backward  # an instance attribute shadows the method
    try:
        yield
    finally:
        del accelerator.backward


def _stepped_grads(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p.grad for p in amp.master_params(optimizer) if p.grad is not None]


def clip_masters(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the gradients the step will use (the FP32 masters at O2, the model's parameters at
    O1/O3) to `max_norm`; returns their norm before clipping (inf or NaN on a step amp skips)."""
    params = list(amp.master_params(optimizer))
    with amp.disable_casts():
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def masters_grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The norm of the gradients the step will use, without clipping them."""
    with amp.disable_casts():
        return torch.nn.utils.get_total_norm(_stepped_grads(optimizer))


class SkipWatch(TrainerCallback):
    """Learns after each optimizer step whether amp skipped it (one host read, as the Trainer's
    GradScaler makes) and tells Accelerate, before the Trainer decides whether to step the LR
    scheduler; counts the skips for the logs and checkpoints."""

    def __init__(self) -> None:
        self.skipped_steps = 0  # in the whole run (checkpoints carry it)
        self.skipped_since_log = 0  # since the last training log (`amp/skipped`)
        self._before: Optional[Any] = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before = amp.last_overflow()

    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
    ) -> None:
        skipped = amp.last_overflow() is not self._before  # a skip leaves a new overflow report
        self.skipped_steps += skipped
        self.skipped_since_log += skipped
        if not hasattr(optimizer, "_is_overflow"):
            raise RuntimeError(
                f"AmpTrainer: the Trainer's optimizer ({type(optimizer).__name__}) has no "
                "_is_overflow, through which Accelerate's AcceleratedOptimizer reports a skipped "
                "step (accelerate 1.15); without it the LR scheduler would advance on a step amp "
                "skipped. Install a checked accelerate version (amp.transformers.versions)."
            )
        optimizer._is_overflow = skipped  # AcceleratedOptimizer.step_was_skipped reads it
