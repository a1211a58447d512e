"""AmpTrainer: transformers.Trainer (5.x) with amp at O0-O3 in one argument, `amp_options`."""

import inspect
from typing import Any, Dict, Mapping, Optional

import accelerate
import torch
import transformers
from transformers import Trainer

import amp
from amp._state import amp_state

from . import checkpoints, holder, options, refusals, steps, versions

__all__ = ["AmpTrainer"]

_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


class AmpTrainer(Trainer):
    """A ``transformers.Trainer`` whose whole run uses amp::

        trainer = AmpTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                             amp_options={"opt_level": "O2", "dtype": torch.bfloat16})
        trainer.train()

    Args:
        *args, **kwargs: the Trainer's own arguments. ``bf16``/``fp16`` (and their ``_full_eval``
            forms), DeepSpeed and FSDP are refused (refusals.py says why and what to use).
        amp_options: ``amp.initialize``'s arguments (``opt_level`` "O2" and ``dtype``
            ``torch.bfloat16`` where not given; ``float8``, ``fp32_modules``,
            ``master_weights``, ``loss_scale``, ``verbosity``, ...).

    amp initializes the model and the optimizer the Trainer builds (or the one passed as
    ``optimizers=``) once, before Accelerate wraps them (DDP). Backward runs inside
    ``amp.scale_loss`` (one unscale per optimizer step with gradient accumulation);
    ``max_grad_norm`` clips what the step uses (the FP32 masters at O2); a step amp skips holds
    the LR scheduler, as the Trainer does when its GradScaler skips, and the training logs carry
    ``amp/loss_scale`` and ``amp/skipped`` (steps skipped since the last log). Checkpoints carry
    ``amp.state_dict()`` (``amp_state.pt``) and resume bit for bit; ``save_model`` writes FP32
    weights (the masters' values at O2) with a float32 config. Evaluation and prediction run in
    the level's precision and return FP32 logits.

    amp stays initialized after ``train()`` (evaluate, predict and save_model run at the level);
    ``deinitialize()`` gives the model its FP32 weights back. amp runs one set-up per process: a
    second AmpTrainer's train(), evaluate() or predict() deinitializes the first (amp's log says
    so), unless the first is training (refused).
    """

    def __init__(
        self, *args: Any, amp_options: Optional[Mapping[str, Any]] = None, **kwargs: Any
    ) -> None:
        versions.check_versions(transformers.__version__, accelerate.__version__, Trainer)
        self.amp_options: Dict[str, Any] = options.initialize_kwargs(amp_options)
        bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs)
        refusals.refuse_arguments(bound.arguments.get("args"))
        self._amp_optimizer: Optional[torch.optim.Optimizer] = None  # the one amp set up
        self._amp_model_only = False  # set up for evaluation, before any optimizer existed
        self._amp_pending: Optional[Dict[str, Any]] = None  # a checkpoint's amp state, early
        self._amp_skips = steps.SkipWatch()
        self._amp_training = False  # inside train(): amp is not handed over to another trainer
        super().__init__(*args, **kwargs)
        refusals.refuse_set_up(self)
        self.add_callback(self._amp_skips)

    @property
    def skipped_steps(self) -> int:
        """The optimizer steps amp skipped after a gradient overflow in this run (a resumed run
        counts the checkpoint's too); ``amp.last_overflow()`` says where the latest came from."""
        return self._amp_skips.skipped_steps

    # -- set-up --------------------------------------------------------------------------------

    def _amp_set_up(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        if self._amp_model_only:  # set up for evaluation: again, with the optimizer
            self.deinitialize()
        model = self.model
        if isinstance(model, _WRAPPERS):
            raise RuntimeError(
                f"AmpTrainer: the model is already wrapped in {type(model).__name__}; amp must "
                "see it bare (the Trainer wraps it after the optimizer exists). Pass the model "
                "itself."
            )
        holder.take_over(self)
        if optimizer is None:
            amp.initialize(model, **self.amp_options)
            holder.claim(self)
            self._amp_model_only = True
            return
        amp.initialize(model, optimizer, **self.amp_options)
        holder.claim(self)
        self._amp_optimizer = optimizer
        if self._amp_pending is not None:
            state, self._amp_pending = self._amp_pending, None
            self._amp_skips.skipped_steps = checkpoints.restore_amp_state(state)

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (or the one passed as ``optimizers=``), set up by amp with the
        model once, before ``accelerator.prepare`` wraps them."""
        if self._amp_optimizer is not None:
            if self.optimizer is not None:
                return self.optimizer  # a later train(): amp set it up already
            self.deinitialize()  # train() reset the optimizer: model_init made a new model
        optimizer = super().create_optimizer(model)
        self._amp_set_up(optimizer)
        return optimizer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's train(); amp set up for evaluation alone is set up again with the
        optimizer (the model gets its FP32 weights back first, for a checkpoint to load into), and
        another AmpTrainer holding amp is deinitialized first (its model may be this one's)."""
        if self._amp_model_only:
            self.deinitialize()
        holder.take_over(self)
        self._amp_training = True
        try:
            return super().train(*args, **kwargs)
        finally:
            self._amp_training = False

    def deinitialize(self) -> None:
        """Undo amp: the model gets its FP32 weights back (from the masters at O2), and torch its
        functions (O1). A later train(), evaluate() or predict() sets amp up again."""
        if self._amp_optimizer is not None or self._amp_model_only:
            amp.deinitialize()
        self._amp_optimizer = None
        self._amp_model_only = False

    # -- the step ------------------------------------------------------------------------------

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: Dict[str, Any],
        num_items_in_batch: Optional[Any] = None,
    ) -> torch.Tensor:
        """The Trainer's training step, its backward inside ``amp.scale_loss``."""
        if self._amp_optimizer is None:
            raise RuntimeError(
                "AmpTrainer.training_step: amp has no optimizer set up; the Trainer calls "
                "create_optimizer() before the first step (call train(), not training_step())."
            )
        with steps.scaled_backward(self.accelerator, self._amp_optimizer):
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        # Private (versions.py pins it): max_grad_norm clips what the step uses.
        return steps.clip_masters(self._amp_optimizer, self.args.max_grad_norm)

    def _get_grad_norm(
        self, model: torch.nn.Module, grad_norm: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        # Private (versions.py pins it): the logged norm is the stepped gradients'.
        return steps.masters_grad_norm(self._amp_optimizer) if grad_norm is None else grad_norm

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        """The Trainer's log(); a training log also gets ``amp/loss_scale`` and ``amp/skipped``
        (the optimizer steps amp skipped since the previous training log)."""
        if "loss" in logs and self._amp_optimizer is not None:
            logs["amp/loss_scale"] = float(amp.state_dict()["loss_scaler0"]["loss_scale"])
            logs["amp/skipped"] = self._amp_skips.skipped_since_log
            self._amp_skips.skipped_since_log = 0
        super().log(logs, start_time)

    # -- checkpoints ---------------------------------------------------------------------------

    def _save_scaler(self, output_dir: str) -> None:
        # Private (versions.py pins it): where the Trainer saves its own GradScaler.
        super()._save_scaler(output_dir)
        if self._amp_optimizer is not None and self.args.should_save:
            checkpoints.save_amp_state(output_dir, self._amp_skips.skipped_steps)

    def _load_scaler(self, checkpoint: str) -> None:
        # Private (versions.py pins it): runs after create_optimizer and the optimizer's state.
        super()._load_scaler(checkpoint)
        state = checkpoints.load_amp_state(checkpoint) if checkpoint else None
        if state is None:
            return
        if self._amp_optimizer is None:
            self._amp_pending = state  # loaded once amp is set up
        else:
            self._amp_skips.skipped_steps = checkpoints.restore_amp_state(state)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The Trainer's save_model(): FP32 weights (the masters' values at O2, through amp's
        state-dict hooks) that ``from_pretrained`` loads, with ``dtype`` float32 in the config."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if amp_state.initialized and self.args.should_save:  # amp's state dicts are FP32
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            checkpoints.fp32_config(model, output_dir or self.args.output_dir)

    # -- evaluation ----------------------------------------------------------------------------

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """evaluate() and predict() in the level's precision, with FP32 outputs; before training,
        amp is set up for the model alone."""
        if self._amp_optimizer is None and not self._amp_model_only:
            self._amp_set_up(None)
        return super().evaluation_loop(*args, **kwargs)
