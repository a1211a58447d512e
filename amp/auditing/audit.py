"""amp.audit(fn, model): run a forward in FP32 and in low precision, module by module.

The FP32 run (amp's casting off) is the reference: every module's outputs are kept, and one
`torch.autograd.grad` of the loss gives the gradients of those outputs, without touching any
`.grad`. The low-precision run (an `amp.autocast` region, i.e. O1) is compared with it as each
module returns. Both runs start from the same weights, buffers and RNG state, and all three are
put back afterwards (a buffer a forward changed, such as batch norm's running stats, is copied
back). Nothing is stepped, so the optimizer is untouched.

With `float8=` (or `dtype="float8"`) the low run is O1 with F.linear in FP8, and each module is
fed the inputs it had in the FP32 run: its error is its own, not the sum of the errors before it
(an FP8 layer with outliers in its weight or input would otherwise hand its error to every module
after it). A third run, FP8 from end to end, gives the loss the report prints.
"""

import math
from collections.abc import Callable
import random

import torch
from torch.utils._pytree import tree_map

from .._state import amp_state
from ..casting.autocast import autocast, disable_casts
from ..lists.float8_recipes import check_recipe_name
from ..scaling.scaler import DEFAULT_INIT_SCALE
from .report import AuditReport, AuditRow

__all__ = ["audit"]

_LOW = (torch.float16, torch.bfloat16)


def _floating(value, found):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _floating(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _floating(item, found)
    return found


class _Snapshot:
    """The model's parameters and buffers and the RNG states, to start each run from and to put
    back at the end, bit for bit. A forward may also assign a new tensor to a buffer
    (``self.calls = self.calls + 1``): the module's slots are put back too."""

    def __init__(self, model):
        self.slots = [
            (slots, dict(slots))
            for module in model.modules()
            for slots in (module._parameters, module._buffers)
            if type(slots) is dict  # not a ScriptModule's
        ]
        self.tensors = [(t, t.detach().clone()) for t in _tensors(model)]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python_rng = random.getstate()

    def restore(self):
        for slots, saved in self.slots:
            if slots.keys() != saved.keys() or any(slots[k] is not v for k, v in saved.items()):
                slots.clear()
                slots.update(saved)
        with torch.no_grad():
            for tensor, saved in self.tensors:
                # Only what changed: a copy bumps the version amp's O2 tables watch.
                if not torch.equal(tensor, saved) or _has_nan(saved):
                    tensor.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)


def _has_nan(tensor):
    return tensor.is_floating_point() and bool(torch.isnan(tensor).any())


def _tensors(model):
    seen, found = set(), []
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append(tensor)
    return found


class _Module:
    """What the two runs measured for one module (summed over its calls)."""

    def __init__(self, name, op):
        self.name, self.op = name, op
        self.reference = []  # per call: the FP32 outputs (clones: later in-place ops change them)
        self.graph = []  # per call: the FP32 outputs autograd can differentiate
        self.max_abs = 0.0
        self.nonzero = self.flushed = 0
        self.calls = 0
        self.order = None  # when its first call returned in the FP32 run
        self.error_sq = self.reference_sq = 0.0
        self.low_nonfinite = False
        self.grad_nonzero = self.grad_flushed = 0
        self.inputs = []  # per call: (args, kwargs) of the FP32 run, for the float8 audit
        self.replayed = 0  # calls of the low run that took them

    def row(self, dtype, with_grads):
        headroom = torch.finfo(dtype).max / self.max_abs if self.max_abs > 0 else math.inf
        if self.low_nonfinite:
            error = math.inf
        elif self.reference_sq > 0:
            error = math.sqrt(self.error_sq / self.reference_sq)
        else:
            error = 0.0 if self.error_sq == 0 else math.inf
        grad = None
        if with_grads:
            grad = self.grad_flushed / self.grad_nonzero if self.grad_nonzero else 0.0
        underflow = self.flushed / self.nonzero if self.nonzero else 0.0
        return AuditRow(
            self.name, self.op, self.calls, headroom, error, underflow, grad, self.order
        )


def _dtype_and_float8(dtype, float8):
    """(low-precision dtype, float8 recipe or None): dtype "float8" is bfloat16 around
    float8 "tensorwise" (or the recipe given)."""
    float8 = check_recipe_name(float8, "amp.audit: float8")
    if isinstance(dtype, str) and dtype == "float8":
        return torch.bfloat16, float8 or "tensorwise"
    return dtype, float8


def _check(fn, model, dtype):
    if not callable(fn):
        raise TypeError(
            f"amp.audit: fn must be a callable that runs a forward and returns the loss; got "
            f"{type(fn).__name__}."
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"amp.audit: model must be a torch.nn.Module; got {type(model).__name__}.")
    if dtype not in _LOW:
        raise ValueError(
            f"amp.audit: dtype must be torch.float16 or torch.bfloat16, the low-precision types "
            f'amp casts to, or "float8" (FP8 linears around bfloat16); got {dtype!r}.'
        )
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and tensor.dtype is not torch.float32:
            raise RuntimeError(
                f"amp.audit: {name} is {tensor.dtype}, but the audit compares against FP32 and "
                "needs the FP32 model. Audit before amp.initialize at O2/O3 (O1 is fine), or "
                "without it."
            )


def _loss_scale(loss_scale):
    if loss_scale is None:
        if amp_state.enabled and amp_state.loss_scalers:
            return amp_state.loss_scalers[0].loss_scale()
        return DEFAULT_INIT_SCALE
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise TypeError(f"amp.audit: loss_scale must be a number; got {loss_scale!r}.")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"amp.audit: loss_scale must be finite and positive; got {loss_scale!r}.")
    return float(loss_scale)


def audit(
    fn: Callable[[], torch.Tensor],
    model: torch.nn.Module,
    dtype: torch.dtype | str = torch.float16,
    loss_scale: float | None = None,
    float8: str | None = None,
) -> AuditReport:
    """Measure how each module of `model` fares in `dtype` (and FP8) against FP32.

    `fn()` runs a forward of `model` and returns the loss. amp calls it twice: once in FP32 and
    once at O1 in `dtype`, from the same weights and RNG state; afterwards the weights, buffers
    and RNG state are as before, and no `.grad` or optimizer has changed.

    With `float8` (or ``dtype="float8"``) the low run has F.linear in FP8 with that recipe, and
    every module runs on the inputs it had in FP32, so that its relative error is the one FP8
    adds there (which layers lose accuracy in FP8); a third run gives the end-to-end FP8 loss.

    Args:
        fn: a callable taking no arguments that returns the loss (a tensor).
        model (torch.nn.Module): the FP32 model `fn` runs (before amp.initialize, or at O1).
        dtype (torch.dtype or str, default=torch.float16): torch.float16 or torch.bfloat16, or
            "float8": bfloat16 with float8 "tensorwise" (unless `float8` names the recipe).
        loss_scale (float, optional): the scale for the gradient underflow column; default the
            current scale of amp's first loss scaler, or 65536 without amp.initialize.
        float8 (str, optional): "tensorwise" or "rowwise": audit F.linear in FP8.

    Returns:
        An AuditReport: ``.rows`` worst first (``.module``, ``.headroom``, ``.relative_error``,
        ``.underflow``, ``.grad_underflow``), ``str(report)`` a table, ``report.suggest()``.

    Example::

        report = amp.audit(lambda: loss_fn(model(x), y), model)
        print(report)
        print(report.suggest())
    """
    dtype, float8 = _dtype_and_float8(dtype, float8)
    _check(fn, model, dtype)
    scale = _loss_scale(loss_scale)
    names = {}
    for name, module in model.named_modules():
        names.setdefault(module, _Module(name, type(module).__name__))
    with amp_state.origin_watch.paused():  # after a skip: the audit is not the watched step
        loss_fp32, loss_low, with_grads = _runs(fn, model, names, dtype, scale, float8)
    rows = [record.row(dtype, with_grads) for record in names.values() if record.calls]
    return AuditReport(rows, dtype, scale, _scalar(loss_fp32), _scalar(loss_low), float8)


def _runs(fn, model, names, dtype, scale, float8):
    """The FP32 run, its output gradients, and the low-precision run, from the same start;
    the model and RNG put back afterwards, also when `fn` raises. With `float8`, each module
    of the low run takes its FP32 inputs, and the loss comes from one more, plain FP8 run."""
    snapshot = _Snapshot(model)
    handles = []
    try:
        returned = []  # the modules in the order their first call returned
        handles = [m.register_forward_hook(_recorder(names[m], dtype, returned)) for m in names]
        if float8 is not None:
            handles += [
                m.register_forward_pre_hook(_input_recorder(names[m]), with_kwargs=True)
                for m in names
            ]
        with disable_casts():
            loss_fp32 = fn()
        with_grads = _gradients(loss_fp32, names.values(), dtype, scale)
        for handle in handles:
            handle.remove()
        snapshot.restore()
        handles = [m.register_forward_hook(_comparer(names[m], dtype)) for m in names]
        if float8 is not None:
            handles += [
                m.register_forward_pre_hook(_input_replayer(names[m]), with_kwargs=True)
                for m in names
            ]
        with autocast(dtype=dtype, float8=float8):
            loss_low = fn()
        if float8 is not None:
            for handle in handles:
                handle.remove()
            handles = []
            snapshot.restore()
            with autocast(dtype=dtype, float8=float8):
                loss_low = fn()
    finally:
        for handle in handles:
            handle.remove()
        snapshot.restore()
    return loss_fp32, loss_low, with_grads


def _detached(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone()
    return value


def _input_recorder(record):
    def hook(module, args, kwargs):
        record.inputs.append(tree_map(_detached, (args, kwargs)))

    return hook


def _input_replayer(record):
    def hook(module, args, kwargs):
        index = record.replayed
        record.replayed += 1
        if index < len(record.inputs):  # else a call the FP32 run did not make: as it comes
            return record.inputs[index]
        return None

    return hook


def _scalar(loss):
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().sum())
    return float(loss)


def _recorder(record, dtype, returned):
    def hook(module, args, output):
        if record.order is None:
            record.order = len(returned)
            returned.append(record)
        tensors = _floating(output, [])
        record.reference.append([t.detach().float().clone() for t in tensors])
        record.graph.extend(t for t in tensors if t.requires_grad)
        for reference in record.reference[-1]:
            finite = reference[torch.isfinite(reference)]
            if finite.numel():
                record.max_abs = max(record.max_abs, float(finite.abs().max()))
            nonzero = reference != 0
            record.nonzero += int(nonzero.sum())
            record.flushed += int((nonzero & (reference.to(dtype) == 0)).sum())

    return hook


def _comparer(record, dtype):
    def hook(module, args, output):
        tensors = _floating(output, [])
        index = record.calls
        record.calls += 1
        if index >= len(record.reference):
            return  # a call the FP32 run did not make (data-dependent control flow)
        for low, reference in zip(tensors, record.reference[index]):
            if low.shape != reference.shape:
                continue
            low = low.detach().float()
            if not bool(torch.isfinite(low).all()):
                record.low_nonfinite = True
                continue
            record.error_sq += float((low - reference).pow(2).sum())
            record.reference_sq += float(reference.pow(2).sum())

    return hook


def _gradients(loss, records, dtype, scale):
    """Count, per module, the nonzero gradients of its outputs that `dtype` flushes to zero at
    `scale`. False (and nothing counted) when the loss has no gradient."""
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
        return False
    records = [record for record in records if record.graph]
    outputs = [t for record in records for t in record.graph]
    if not outputs:
        return True
    grads = torch.autograd.grad(
        loss, outputs, grad_outputs=torch.ones_like(loss), allow_unused=True
    )
    position = 0
    for record in records:
        for grad in grads[position : position + len(record.graph)]:
            if grad is None:
                continue
            nonzero = grad != 0
            scaled = (grad.float() * scale).to(dtype)
            record.grad_nonzero += int(nonzero.sum())
            record.grad_flushed += int((nonzero & (scaled == 0)).sum())
        position += len(record.graph)
        record.graph = []
    return True
