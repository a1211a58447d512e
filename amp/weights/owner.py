"""The owner of an optimizer's O2 state where amp steps it (torch's AdamW, Adam and SGD:
fused_step.py): the one place that holds, for each parameter, its master's rest, its moments in
their stored form and its step count, and the one that steps them.

What the user holds is real. `optimizer.param_groups` hold the model's own parameters (bf16 or
fp16, batch norm's FP32 ones), never a copy or a placeholder, and each parameter's
`optimizer.state` entry holds all of its state (forms.py): so `optimizer.state_dict()` is that
state as it is (torch's format with `fp32` moments, plus the master's rest), and torch's
distributed checkpoint (`get_state_dict` / `set_state_dict`) maps it to the model's names. A
cast parameter's FP32 value is its weight and its rest (rows.py): FP32 masters (fp16 models),
bf16 weights with int16 remainders (exact) or int8 corrections (compact).

Gradients: scale_loss's exit leaves a cast parameter's gradient in low precision and still
scaled, checked (`keep`), and the step unscales it as it reads it; an accumulation over blocks,
or a reader, makes FP32 master gradients (`grads`, `materialize`). `amp.master_params` hands out
FP32 values (rows.lend) carrying those gradients: what a clipping leaves on them is what the step
uses. A step makes the state of the parameters stepped for the first time (zero moments, step 0:
what torch's first step finds), only once it is known to be taken, and changes nothing where it
refuses a group; a step skipped on the device changes no bit.
"""

import itertools
import operator
import weakref

import torch

from .. import kernels
from .._state import amp_state
from . import fused_step
from .columns import GRAD, IS_SPARSE, NONES, consume, repeat
from .forms import check_entry
from .rows import FP32, Rows

__all__ = ["Kept", "StateOwner"]

_NOT_NONE = operator.is_not
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


class Kept:
    """The cast parameters' gradients of one scale_loss block, kept low precision and scaled by
    the inverse of `inv_scale` for the step (`rows`: their rows)."""

    __slots__ = ("rows", "grads", "inv_scale")

    def __init__(self, rows, grads, inv_scale):
        self.rows, self.grads, self.inv_scale = rows, grads, inv_scale


class StateOwner(Rows):
    """The O2 state of one optimizer amp steps: `kind` ("adam" or "sgd"), its state's `form`
    (forms.StateForm)."""


    def __init__(self, optimizer, kind, form):
        super().__init__(form.master)
        self.optimizer, self.kind, self.state_form = optimizer, kind, form
        self.grads = []  # per row: its FP32 master gradient (unscaled), or None
        self._no_grads = []  # None per row
        self.kept = None  # Kept, or None
        # {row: the FP32 value amp.master_params handed out}: what is on it at the step (what a
        # clipping left there, or None) is the gradient stepped; held until that step
        self.handed = {}
        # {row: a weak reference to it}: while someone holds it, each exit puts the row's new FP32
        # master gradient on it (a list of master params taken once clips every step)
        self._handed_weak = {}
        self._handed_from = {}  # {row: the gradient its value's was made from}
        self._copies = {}  # {row: (the model's .grad amp placed as a copy, its version)}
        self._key = operator.itemgetter(form.master.key)

    # -- the rests, in the parameters' state entries ---------------------------------------------

    def rests(self):
        return list(map(self._key, map(self.optimizer.state.__getitem__, self.params)))

    def rest(self, row):
        return self.optimizer.state[self.params[row]][self.form.key]

    def _set_rest(self, row, rest):
        self.optimizer.state[self.params[row]][self.form.key] = rest

    def add(self, param, rest=None):
        """A row for the cast parameter `param`: FP32 (initialize; it becomes its weight, amp's
        write), or low precision with its `rest` (one that joins from the frozen rows)."""
        with torch.no_grad():
            if rest is None:
                low, rest = self.form.encode(param.detach().float())
                param.data = low
            if param.grad is not None:
                grad, param.grad = param.grad.detach().float(), None
            else:
                grad = None
        entry = self.optimizer.state[param]
        entry[self.form.key] = rest
        if self.kind == "adam":  # torch's Adam takes an entry with no step count for corrupt
            entry.setdefault("step", torch.zeros((), dtype=torch.float32, device=param.device))
        row = self._add(param)
        self.grads.append(grad)
        self._no_grads = [None] * len(self.params)
        self.mark_row(row)
        amp_state.owners[id(param)] = self
        return row

    def convert_state(self, param, index):
        """`param`'s state entry, as loaded before amp.initialize (torch's format, any form, the
        dtypes torch's load cast), in this form; the master's rest is made from the parameter."""
        entry = self.optimizer.state.get(param)
        if entry:
            in_form = self.state_form.in_form(param, id(param) in self.index)
            check_entry(entry, param, index)
            converted = self.state_form.from_torch(entry, param, in_form)
            entry.clear()
            entry.update(converted)

    # -- the parameters, the gradients ------------------------------------------------------------

    def plain(self, groups):
        """The parameters of `groups` with no row (FP32 ones kept FP32, batch norm's)."""
        index = self.index
        return [p for group in groups for p in group["params"] if id(p) not in index]

    def master_grads(self):
        return self.grads

    def set_master_grads(self, rows, grads):
        consume(map(self.grads.__setitem__, rows, grads))

    def in_model(self, device):
        """Whether a block's fresh gradients stay in the model's `.grad`, unscaled in place: a bf16
        model's (the power-of-two unscale is exact in bf16, and the step reads them as they are:
        a clipping of the model's or the param groups' gradients is what it steps). An fp16
        model's are made FP32 master gradients (unscaled in fp16 they would lose the small ones)
        or, on the CuPy kernels, kept scaled for the step (`keep`)."""
        return self.form.dtype is torch.bfloat16

    def keeps_on(self, device):
        """Whether a block's gradients on `device` stay low precision and scaled for the step
        (`keep`): an fp16 model's on the CuPy kernels, which unscale them as the step reads
        them; the torch backend makes FP32 master gradients at the exit (a quarter at a time)."""
        return self.form.dtype is torch.float16 and kernels.fuses(device)

    def keep(self, rows, grads, inv_scale):
        """A block's fresh gradients of `rows`, low precision and scaled, for the step."""
        self.kept = Kept(rows, grads, inv_scale)

    def place_copies(self, rows):
        """A bf16 model's FP32 master gradients (an accumulation over blocks) of `rows` as the
        model's `.grad` too, rounded: what a clipping of the model's gradients reads; a write to
        them is what the step uses (`_source`)."""
        if self.form.dtype is not torch.bfloat16 or not rows:
            return
        params = [self.params[row] for row in rows]
        copies = [torch.empty_like(p) for p in params]
        torch._foreach_copy_(copies, [self.grads[row] for row in rows])
        for row, param, copy in zip(rows, params, copies):
            param.grad = copy
            self._copies[row] = (copy, copy._version)

    def open_block(self):
        """A scale_loss block opens: kept gradients made FP32 (they join the accumulation); the
        model's copies of FP32 master gradients let go (a written one is the master gradient
        now)."""
        self.materialize()
        copies, self._copies = self._copies, {}
        for row, (copy, version) in copies.items():
            param = self.params[row]
            if param.grad is copy and copy._version == version:
                param.grad = None
            elif param.grad is not None:  # written since amp placed it: that is the gradient
                self.grads[row], param.grad = param.grad.float(), None

    def materialize(self):
        """The kept gradients as FP32 master gradients, unscaled as the step would (a read of the
        masters, an accumulation)."""
        kept, self.kept = self.kept, None
        if kept is None:
            return
        fresh = [torch.empty_like(grad, dtype=torch.float32) for grad in kept.grads]
        scratch = torch.zeros((), dtype=torch.float32, device=kept.inv_scale.device)
        kernels.unscale_to_(kept.grads, fresh, kept.inv_scale, scratch, check=False)
        grads = self.grads
        for row, grad in zip(kept.rows, fresh):
            grads[row] = grad

    def drop_grads(self, zero=False):
        """The master gradients go (a step, a skip, zero_grad), a bf16 model's with its `.grad`;
        `zero`: they are zeroed and stay (zero_grad(set_to_none=False): a parameter unused in the
        next step is stepped with its zero gradient, as torch steps it)."""
        if zero:
            self.materialize()
            for grad in self.grads:
                if grad is not None:
                    grad.zero_()
            for param in self.params:
                if param.grad is not None:
                    param.grad.detach_()
                    param.grad.zero_()
        else:
            self.kept = None
            self.grads = list(self._no_grads)
            consume(map(setattr, self.params, repeat("grad"), NONES))
        self._copies = {}
        if self.handed:  # amp.master_params' values carried them
            for value in self.handed.values():
                value.grad = None
            self.handed, self._handed_from = {}, {}

    def _sources(self):
        """Each row's gradient for the step: what amp.master_params' value carries; else the
        model's `.grad` where there is no FP32 master gradient or it was written since amp made
        it the master gradient's copy; else the FP32 master gradient (kept ones apart)."""
        grads = self._sources_plain()
        made_from = self._handed_from
        for row, value in self.handed.items():
            if grads[row] is made_from.get(row):  # no gradient came since it was handed out
                grads[row] = value.grad
        return grads

    def _sources_plain(self):
        """_sources without amp.master_params' values."""
        grads = list(self.grads)
        params = self.params
        for row, grad in enumerate(grads):
            model = params[row].grad
            if grad is None:
                grads[row] = model
            elif model is not None:
                copy = self._copies.get(row)
                if copy is None or model is not copy[0] or model._version != copy[1]:
                    grads[row] = model
        return grads

    def exited(self):
        """A scale_loss block exited: amp.master_params' values someone still holds carry the
        rows' new FP32 master gradients (what their clipping acts on)."""
        if self._handed_weak:
            alive = [row for row, ref in self._handed_weak.items() if ref() is not None]
            self._handed_weak = {row: self._handed_weak[row] for row in alive}
            if alive:
                self._hand(alive)

    def _hand(self, rows):
        """The rows' FP32 values, lent, each with its FP32 master gradient on it (held until the
        step reads them)."""
        self.materialize()
        sources = self._sources_plain()
        values = []
        for row in rows:
            value = self.handed[row] = self.lend(row)
            self._handed_weak[row] = weakref.ref(value)
            grad = self._handed_from[row] = sources[row]
            value.grad = None if grad is None else grad.float()
            values.append(value)
        return values

    def held_grads(self):
        """[(parameter, the gradient the step would take or None)] of every row, in row order
        (the same list on every rank: a skip's report is a collective)."""
        held = self._sources()
        kept = self.kept
        if kept is not None:
            for row, grad in zip(kept.rows, kept.grads):
                held[row] = grad
        return list(zip(self.params, held))

    def master_params(self):
        """What amp.master_params yields: for each parameter of the groups, its FP32 value lent
        (rows.lend) with its FP32 master gradient on it, or a plain parameter itself."""
        index = self.index
        groups = self.optimizer.param_groups
        params = [p for group in groups for p in group["params"]]
        rows = [index.get(id(p)) for p in params]
        values = iter(self._hand([row for row in rows if row is not None]))
        return [param if row is None else next(values) for param, row in zip(params, rows)]

    # -- the step -------------------------------------------------------------------------------

    def step(self, found_inf, learn):
        """One step between the step's hooks (fused_step.run); skipped on the device where
        `found_inf` is set. `learn()` waits for the step's checks and says whether it is skipped:
        asked only where state must be made. Every group is planned before anything changes."""
        fused_step.run(self.optimizer, lambda: self._step(found_inf, learn))

    def _step(self, found_inf, learn):
        calls, first = self._plan()
        if first and found_inf is not None and learn():
            return  # skipped: no state is made
        made = set()
        state = self.optimizer.state
        for param, momentum, in_form in first:
            if self.state_form.start(param, state[param], momentum, in_form):
                made.add(id(param))
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        rests = [None] * len(self.params) if self.form.name == FP32 else None
        try:
            for call in calls:
                self._launch(call, made, found_inf, rests)
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        if rests is not None and None in rests:  # rows no call stepped
            rests = None
        self.written_by_amp(rests)

    def _plan(self):
        """(the kernel calls of this step, [(param, momentum, in_form)] whose state a first step
        makes); raises, changing nothing, for a group the fused step cannot step. A group's rows
        with FP32 gradients and its plain parameters are one call (the kernels split what their
        forms need apart); its kept gradients, scaled, another."""
        optimizer, kind, form = self.optimizer, self.kind, self.state_form
        index_get = self.index.get
        kept = self.kept
        # the rows' gradients; the usual case: a bf16 model's in its `.grad`, read below
        fresh = not (self.handed or self._copies) and all(map(operator.is_, self.grads, NONES))
        fp32 = None if fresh else self._sources()
        calls, first = [], []
        state_get = optimizer.state.get
        for number, group in enumerate(optimizer.param_groups):
            options = fused_step.options_of(kind, group)
            if options is None:
                raise RuntimeError(
                    f"optimizer.step(): param_groups[{number}] "
                    f"{fused_step.uncovered(kind, group)}, which amp's fused step at O2 does not "
                    f"compute, and it steps this {type(optimizer).__name__}'s parameters (their "
                    "masters, moments and step counts are in its state). Nothing was changed. "
                    "Keep the hyperparameters numbers (an LR scheduler's too) and those options "
                    "off, or pass the optimizer to amp.initialize with them set (every step is "
                    "then its own, on FP32 masters)."
                )
            momentum = kind == "adam" or options.momentum != 0
            params = group["params"]
            rows = list(map(index_get, map(id, params)))
            if kept is not None:
                scaled_of = dict(zip(kept.rows, kept.grads))
                self._add_call(calls, number, options, momentum, kept.inv_scale, params, rows,
                               list(map(scaled_of.get, rows)))
            if fp32 is None:  # every gradient where the parameters hold it
                grads = list(map(GRAD, params))
            elif None not in rows:  # only rows
                grads = list(map(fp32.__getitem__, rows))
            else:  # a plain parameter's own gradient
                grads = [p.grad if r is None else fp32[r] for p, r in zip(params, rows)]
            self._add_call(calls, number, options, momentum, None, params, rows, grads)
        for call in calls:
            call.states = states = list(map(state_get, call.params))
            if not form.all_have_state(states, call.momentum, call.in_form):
                for param, entry in zip(call.params, states):
                    if entry is None or not form.has_state(entry, call.momentum, call.in_form):
                        first.append((param, call.momentum, call.in_form))
        return calls, first

    def _add_call(self, calls, number, options, momentum, inv_scale, params, rows, grads):
        """The call of a group's parameters whose gradients in `grads` are there (none: none)."""
        present = list(map(_NOT_NONE, grads, NONES))
        if not all(present):
            if not any(present):
                return
            params = list(itertools.compress(params, present))
            rows = list(itertools.compress(rows, present))
            grads = list(itertools.compress(grads, present))
        call = _Call(options, momentum, inv_scale, params, grads, rows)
        self._check_grads(call, number)
        calls.extend(call.split_by_form(self.state_form))

    def _check_grads(self, call, number):
        if any(map(IS_SPARSE, call.grads)) and self.kind == "adam":
            raise RuntimeError(
                f"optimizer.step(): param_groups[{number}] has a sparse gradient, which "
                f"{type(self.optimizer).__name__} does not support (torch's raises too); use "
                "torch.optim.SparseAdam for sparse embeddings. Nothing was changed."
            )
        if list(map(_SHAPE, call.grads)) == list(map(_SHAPE, call.params)):
            return
        for param, grad in zip(call.params, call.grads):
            if grad.shape != param.shape:
                raise RuntimeError(
                    f"optimizer.step(): a gradient of shape {tuple(grad.shape)} for a parameter "
                    f"of shape {tuple(param.shape)} (param_groups[{number}]). Nothing was changed."
                )

    def _launch(self, call, made, found_inf, rests=None):
        params, rows = call.params, call.rows
        states = call.states
        if made:  # the entries a first step made
            state = self.optimizer.state
            states = [state[p] if s is None else s for p, s in zip(params, states)]
        moments, scales, steps = self.state_form.tensors(states, call.momentum, call.in_form)
        grads = [g.to_dense() if g.is_sparse else g for g in call.grads]  # SGD's, as torch adds
        key = self.form.key
        if all(map(_NOT_NONE, rows, NONES)):
            lows, masters = params, [state[key] for state in states]
        else:  # a plain parameter is its own FP32 master, without a copy
            lows = [p if r is not None else None for p, r in zip(params, rows)]
            masters = [s[key] if r is not None else p for p, r, s in zip(params, rows, states)]
            if any(map(torch.is_complex, params)):  # stepped as torch does: their real views
                masters = list(map(_real, masters))
                grads = list(map(_real, grads))
                moments = [None if m is None else list(map(_real, m)) for m in moments]
        if rests is not None:  # the FP32 masters, for the marks
            for row, master in zip(rows, masters):
                if row is not None:
                    rests[row] = master
        if self.kind == "adam":
            kernels.adam_step_(
                grads, lows, masters, moments[0], moments[1], _on_device(steps, states, params),
                call.options, scales=None if scales is None else tuple(scales),
                inv_scale=call.inv_scale, found_inf=found_inf,
            )
            return
        if not (made and call.momentum):  # no buffer starts: one call
            kernels.sgd_step_(
                grads, lows, masters, moments[0] if call.momentum else [], call.options,
                scales=None if scales is None else scales[0], inv_scale=call.inv_scale,
                found_inf=found_inf,
            )
            return
        starting = list(map(made.__contains__, map(id, params)))
        for first_step in (True, False):
            picked = [i for i, s in enumerate(starting) if s is first_step]
            if not picked:
                continue
            kernels.sgd_step_(
                _pick(grads, picked), _pick(lows, picked), _pick(masters, picked),
                _pick(moments[0], picked) if call.momentum else [], call.options,
                scales=None if scales is None else _pick(scales[0], picked),
                first_step=first_step, inv_scale=call.inv_scale, found_inf=found_inf,
            )

    # -- undo ---------------------------------------------------------------------------------

    def give_back(self):
        """deinitialize (after the model has its FP32 weights back): every state entry in
        torch's FP32 format, its step count where torch's step keeps it; the master gradients
        on the FP32 parameters."""
        self.materialize()
        for row, param in enumerate(self.params):
            if self.grads[row] is not None and param.dtype is torch.float32:
                param.grad = self.grads[row]
            amp_state.owners.pop(id(param), None)
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for param in group["params"]:
                entry = state.get(param)
                if entry is None:
                    continue
                converted = self.state_form.to_torch(entry, param)
                step = converted.get("step")
                if isinstance(step, torch.Tensor) and not on_device:
                    converted["step"] = step.cpu()
                moments = {m for m, _ in self.state_form.moment_names} & converted.keys()
                if moments:
                    state[param] = converted
                else:  # never stepped: torch's step makes its state, as at its first step
                    del state[param]
        self.kept, self.grads = None, list(self._no_grads)


class _Call:
    """One kernel call's parameters, gradients and rows (None: a plain parameter), of one group,
    one scale and one kind of moments."""

    __slots__ = ("options", "momentum", "inv_scale", "params", "grads", "rows", "in_form", "states")

    def __init__(self, options, momentum, inv_scale, params, grads, rows, in_form=True):
        self.options, self.momentum, self.inv_scale = options, momentum, inv_scale
        self.params, self.grads, self.rows, self.in_form = params, grads, rows, in_form
        self.states = None  # their state entries (None: none yet), found by the plan

    def split_by_form(self, form):
        """This call, or its parameters apart by whether their moments take the form (cast and
        FP32 ones) or torch's format (other dtypes)."""
        fp32 = map(operator.is_, map(_DTYPE, self.params), repeat(torch.float32))
        in_form = list(map(operator.or_, map(_NOT_NONE, self.rows, NONES), fp32))
        if all(in_form):
            return [self]
        parts = []
        for wanted in (True, False):
            picked = [i for i, f in enumerate(in_form) if f is wanted]
            if picked:
                parts.append(_Call(
                    self.options, self.momentum, self.inv_scale, _pick(self.params, picked),
                    _pick(self.grads, picked), _pick(self.rows, picked), wanted,
                ))
        return parts


def _pick(values, indices):
    return None if values is None else [values[i] for i in indices]


def _real(tensor):
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _on_device(steps, states, params):
    """Step counts kept on the host (torch's non-capturable foreach and for-loop steps keep them
    there) moved to their parameters' device, once: the kernels count them there."""
    if not steps or steps[0].device == params[0].device:
        return steps
    for param, state in zip(params, states):
        state["step"] = state["step"].to(param.device)
    return [state["step"] for state in states]

