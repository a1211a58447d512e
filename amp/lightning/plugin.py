"""AmpPrecision's behaviour: amp.initialize, scale_loss and amp's steps inside Lightning's hooks.

Written once for every copy of Lightning (flavours.py builds the class). The Trainer hands the
plugin its LightningModule and optimizers in `connect`, after the model is on its device and, under
DDP, already wrapped: amp.initialize then runs on the LightningModule itself and DDP is built again
around the cast model (ddp.py: a DistributedDataParallel built for FP32 parameters would no longer
reduce their gradients). Fabric hands a precision plugin only the module, never the optimizers,
so with Fabric `amp.lightning.setup(fabric, model, optimizer)` calls `initialize` before
`fabric.setup`.

The hooks hand their parts on: options.py checks the arguments, conversions.py casts batches and
outputs, skips.py counts skipped steps, held.py keeps the gradients a backward left scaled for a
step, logs.py writes amp's metrics into the Trainer's logs.
"""

import contextlib
import copy
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

import amp

from . import conversions, ddp, flavours, logs, options
from .held import HeldGradients
from .skips import SkipCount, checks_deciding

__all__ = ["AmpPrecisionBehaviour"]

_DDP = torch.nn.parallel.DistributedDataParallel


class AmpPrecisionBehaviour:
    """A Lightning precision plugin running amp: O1, O2 (FP32 master weights) or O3.

    Works with ``lightning.pytorch.Trainer``, ``pytorch_lightning.Trainer`` and
    ``lightning.fabric.Fabric`` (through ``amp.lightning.setup``)::

        trainer = Trainer(plugins=[AmpPrecision(opt_level="O2", dtype=torch.bfloat16)])

    Args:
        opt_level: "O0", "O1", "O2" (default: a low-precision model stepped through FP32 master
            weights) or "O3".
        dtype: the low-precision type, ``torch.bfloat16`` (default) or ``torch.float16``.
        log: log ``amp/loss_scale`` and ``amp/skipped_steps`` from the Trainer at the steps it
            writes its logs (``log_every_n_steps``) and at the last step of each epoch and of the
            run: only there does the host wait for the device to learn them.
        **initialize_kwargs: any other argument of ``amp.initialize`` (``loss_scale``,
            ``keep_batchnorm_fp32``, ``num_losses``, ``verbosity``, ``fp32_modules``, ...).

    ``skipped_steps`` counts the optimizer steps amp skipped after a gradient overflow, and
    ``last_step_skipped`` says whether the latest one was; ``amp.last_overflow()`` says where the
    overflow came from. A step does not wait for the device to say whether it was skipped: the
    plugin learns it when the device's answer has reached the host anyway, or when one of these
    is read (which then waits for it). Checkpoints carry amp's loss scalers (``state_dict``).
    """

    def __init__(
        self,
        opt_level: str = "O2",
        dtype: torch.dtype = torch.bfloat16,
        *,
        log: bool = False,
        **initialize_kwargs: Any,
    ) -> None:
        options.check(opt_level, dtype, initialize_kwargs)
        super().__init__()
        self.opt_level = opt_level
        self.dtype = dtype
        self.log = log
        self.initialize_kwargs = dict(initialize_kwargs)
        self.precision = options.precision_name(opt_level, dtype)
        self._skips = SkipCount()
        self._held = HeldGradients()  # several optimizers, none named: `backward`
        self._models: List[torch.nn.Module] = []  # the modules amp.initialize took
        self._optimizers: List[torch.optim.Optimizer] = []
        self._fabric_modules: List[Any] = []  # Fabric's wrappers of them (amp.lightning.setup)
        self._initialized = False
        self._input_dtype: Optional[torch.dtype] = None  # O2/O3: the model's dtype, for batches
        self._trainer_base: Optional[type] = None  # the Trainer's Precision class; None: Fabric
        self._ddps: List[_DDP] = []  # the DDP wrappers, whose no_sync() marks accumulation
        # amp's state while no set-up holds it (loaded before one, or left by the last), in
        # `state_dict`'s form: what state_dict() returns then, and the next set-up loads.
        self._kept_state: Optional[Dict[str, Any]] = None

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.initialize_kwargs.items())
        return f"AmpPrecision(opt_level={self.opt_level!r}, dtype={self.dtype}{extra})"

    # -- set-up --------------------------------------------------------------------------------

    def initialize(
        self, model: torch.nn.Module, optimizers: Optional[List[torch.optim.Optimizer]]
    ) -> None:
        """Run amp.initialize on `model` (FP32, on its device, not wrapped) and `optimizers`.

        The Trainer calls it through `connect`, `amp.lightning.setup` for Fabric; None as
        `optimizers` (evaluation) casts the model only. With Fabric a model set up after others
        joins them: amp.initialize takes every model and optimizer at once, so it runs again with
        all of them (the earlier ones get their FP32 weights back first), amp's state kept.
        """
        optimizers = [flavours.unwrap_optimizer(o) for o in optimizers or []]
        if not self._initialized:
            self._set_up([model], optimizers)
            return
        if self._trainer_base is not None:
            raise RuntimeError(
                "AmpPrecision: this plugin already set up a model for the Trainer; tear down "
                "first."
            )
        self._set_up_again(self._models + [model], self._optimizers + optimizers)

    def _set_up_again(self, models: List[torch.nn.Module], optimizers: List[Any]) -> None:
        """amp.initialize undone and run again with `models` and `optimizers`, amp's state kept;
        where that fails, set up again as before, and raise."""
        earlier = self._models, self._optimizers
        self._undo()
        try:
            self._set_up(models, optimizers)
        except BaseException:
            self._set_up(*earlier)
            raise

    def _set_up(self, models: List[torch.nn.Module], optimizers: List[Any]) -> None:
        amp.initialize(
            list(models),
            list(optimizers) or None,
            opt_level=self.opt_level,
            dtype=self.dtype,
            **self.initialize_kwargs,
        )
        self._initialized = True
        self._models, self._optimizers = list(models), list(optimizers)
        properties = amp._amp_state.opt_properties  # None where enabled=False
        cast = getattr(properties, "cast_model_type", None)
        self._input_dtype = cast if cast in options.LOW_PRECISION else None
        if self._kept_state is not None:
            state, self._kept_state = self._kept_state, None
            self.load_state_dict(state)

    def connect(
        self, model: torch.nn.Module, optimizers: List[Any], lr_schedulers: List[Any]
    ) -> Tuple[torch.nn.Module, List[Any], List[Any]]:
        """The Trainer's hook: the model on its device (DDP-wrapped under DDP), its optimizers."""
        module = model.module if isinstance(model, _DDP) else model
        flavour = flavours.of_module(module)
        trainer = module.trainer
        fitting = trainer.state.fn == "fit"
        self.initialize(module, list(optimizers) if fitting else None)
        self._trainer_base = flavour.precision
        if isinstance(model, _DDP):
            model = ddp.wrap_again(trainer.strategy, module)
            self._ddps = [model]
        if fitting:
            optimizers = flavours.lightning_optimizers(flavour, optimizers)
        return model, optimizers, lr_schedulers

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Nothing to convert here: amp.initialize casts the model when it sees the optimizers."""
        if self._initialized or getattr(module, "_trainer", None) is not None:
            return module  # set up by amp.lightning.setup, or the Trainer's connect() will
        raise RuntimeError(
            "AmpPrecision with Fabric: call `model, optimizer = amp.lightning.setup(fabric, model, "
            "optimizer)` instead of fabric.setup(...). amp.initialize needs the model together "
            "with its optimizers (O2's FP32 master weights are made from the FP32 model), before "
            "DDP wraps the model; Fabric hands a precision plugin the model alone."
        )

    def teardown(self) -> None:
        """Undo amp.initialize: the model gets its FP32 weights back (from the masters at O2).
        amp's state stays with the plugin, as Lightning's "16-mixed" keeps its GradScaler: a
        checkpoint saved after ``fit`` carries it, and a later set-up continues from it."""
        self._undo()
        self._fabric_modules = []

    def _undo(self) -> None:
        """amp.deinitialize(), amp's state kept for the next set-up."""
        if self._initialized:
            self._kept_state = self.state_dict()
            self._initialized = False
            self._models, self._optimizers, self._ddps = [], [], []
            self._held = HeldGradients()
            amp.deinitialize()

    # -- forward -------------------------------------------------------------------------------

    def forward_context(self) -> contextlib.AbstractContextManager:
        """No region: amp.initialize's casts are in force from set-up to teardown."""
        return contextlib.nullcontext()

    def convert_input(self, data: Any) -> Any:
        """At O2/O3 the batch's floating tensors (not float64) reach the model in its dtype, as
        with Lightning's "bf16-true": training_step may call submodules directly."""
        if self._input_dtype is None:
            return data
        return conversions.to_model_dtype(data, self._input_dtype)

    def convert_output(self, data: Any) -> Any:
        """Fabric's model outputs in FP32 (torch's default dtype), as from Lightning's mixed
        plugins: at O2/O3 amp's forward hook made them so already, at O1 the last op ran in
        `dtype`. float64 stays float64."""
        return conversions.to_default_dtype(data)

    # -- backward ------------------------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if self._trainer_base is None:
            return None
        return self._trainer_base.pre_backward(self, tensor, module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """Backward through ``amp.scale_loss``, tied to the optimizer whose step follows.

        The Trainer's automatic optimization names it, and one optimizer set up alone is it: the
        gradients are unscaled and checked when backward ends. With several and none named
        (manual optimization, Fabric) the gradients stay scaled, held by the optimizers whose
        parameters require gradients (``toggle_optimizer`` leaves one), and each optimizer's
        ``step()`` (or Lightning's gradient clipping before it) unscales and checks its own,
        as Lightning's "16-mixed" does: an inf in one model's gradients skips its optimizer's
        step only. ``loss_id=i`` (e.g. ``self.manual_backward(loss, loss_id=1)``) picks amp's
        loss scaler. A backward that DDP does not synchronise (gradient accumulation in
        ``no_sync``) leaves its gradients scaled for the synchronised one to unscale, as amp
        requires under DDP.
        """
        self._require_initialized("backward")
        loss_id = kwargs.pop("loss_id", 0)
        optimizer = None
        if self._trainer_base is not None:  # the Trainer passes the optimizer (None: manual)
            optimizer, args = (args[0] if args else None), args[1:]
        if not self._optimizers:
            raise RuntimeError(
                "AmpPrecision.backward: no optimizer was set up with the model, so no gradient "
                "would be unscaled. Pass the optimizers to amp.lightning.setup / the Trainer."
            )
        delay = any(not wrapper.require_backward_grad_sync for wrapper in self._ddps)
        untied = optimizer is None and len(self._optimizers) > 1
        if not untied:
            optimizers = [flavours.unwrap_optimizer(optimizer)] if optimizer else self._optimizers
        else:
            optimizers = self._held.holders(self._optimizers)
            delay = True
        with amp.scale_loss(tensor, optimizers, loss_id=loss_id, delay_unscale=delay) as scaled:
            if self._trainer_base is not None:
                self._trainer_base.backward(self, scaled, model, optimizer, *args, **kwargs)
            else:
                scaled.backward(*args, **kwargs)
        if untied:
            self._held.hold(optimizers, loss_id, tensor)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if self._trainer_base is None:
            return None
        return self._trainer_base.post_backward(self, tensor, module)

    # -- step ----------------------------------------------------------------------------------

    def optimizer_step(
        self,
        optimizer: Any,
        model: Any = None,
        closure: Optional[Callable[[], Any]] = None,
        **kwargs: Any,
    ) -> Any:
        """Step through amp: skipped, changing nothing, after a gradient overflow.

        With the Trainer the closure (training_step and backward) runs first, then the
        ``on_before_optimizer_step`` hooks and gradient clipping on the FP32 masters, as in
        Lightning's own plugins. LR schedulers step as Lightning schedules them, skipped step or
        not (as with Lightning's "16-mixed" and torch's GradScaler).
        """
        optimizer = flavours.unwrap_optimizer(optimizer)
        if closure is None:  # Fabric: the user ran backward already
            return self._step(optimizer, model, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "AmpPrecision: LBFGS re-evaluates the loss through a closure inside step(), "
                "which amp does not support (scale_loss unscales once per backward)."
            )
        closure_result = closure()
        self._held.unscale(optimizer)  # for on_before_optimizer_step's hooks and the clipping
        self._trainer_base._after_closure(self, model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, so no step (Lightning's rule)
        return self._step(optimizer, model, **kwargs)

    def _step(self, optimizer: Any, model: Any, **kwargs: Any) -> Any:
        self._held.unscale(optimizer)
        checks = checks_deciding(optimizer)
        output = optimizer.step(**kwargs)
        self._skips.record(checks)  # learned once the checks' copies reach the host: no wait
        if self.log and self._trainer_base is not None:
            logs.log_step(model, self._skips)
        return output

    @property
    def skipped_steps(self) -> int:
        """The optimizer steps amp skipped (waits for the device's answer about the last ones)."""
        return self._skips.skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skips.reset(value)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest optimizer step was skipped (waits for the device's answer)."""
        return self._skips.last_skipped

    # -- gradient clipping ---------------------------------------------------------------------

    def main_params(self, optimizer: Any) -> Iterator[torch.nn.Parameter]:
        """The parameters the optimizer steps: amp's FP32 masters at O2 (clipped by Lightning)."""
        optimizer = flavours.unwrap_optimizer(optimizer)
        if not self._initialized:
            return (p for group in optimizer.param_groups for p in group["params"])
        return amp.master_params(optimizer)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Gradients a backward left scaled for `optimizer` are unscaled now (Fabric's
        clip_gradients); others were unscaled when their backward ended."""
        self._held.unscale(flavours.unwrap_optimizer(optimizer))

    def _clip_gradients(self, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self._trainer_base._clip_gradients(self, model, optimizer, *args, **kwargs)

    def clip_gradients(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        optimizer = flavours.unwrap_optimizer(optimizer)
        self._held.unscale(optimizer)  # manual optimization clips before the step
        base = self._trainer_base or flavours.installed()[0].precision
        base.clip_gradients(self, optimizer, *args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """amp's loss scalers (plain Python values) and the count of skipped steps; between
        set-ups (after ``fit``) the state the last one left, or one loaded since ({} if none)."""
        if not self._initialized:
            return copy.deepcopy(self._kept_state) if self._kept_state is not None else {}
        return {"amp": dict(amp.state_dict()), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what `state_dict` saved (or a bare ``amp.state_dict()``); between set-ups it
        is kept and loaded when amp.initialize has run."""
        amp_state = state_dict.get("amp", state_dict)
        amp_state = {k: v for k, v in amp_state.items() if k != "skipped_steps"}
        skipped = int(state_dict.get("skipped_steps", 0))
        if not self._initialized:
            self._kept_state = {"amp": copy.deepcopy(amp_state), "skipped_steps": skipped}
            return
        amp.load_state_dict(amp_state)
        self.skipped_steps = skipped

    def _require_initialized(self, caller: str) -> None:
        if not self._initialized:
            raise RuntimeError(
                f"AmpPrecision.{caller}: amp was not set up; with Fabric use "
                "amp.lightning.setup(fabric, model, optimizer)."
            )
