"""The owner of an optimizer's O2 state where amp steps it (torch's AdamW, Adam and SGD, by
fused_step.py): the one place that holds, for each parameter, its master's rest, its moments in
their stored form, its step count and its gradient until the step.

What the user holds is real. `optimizer.param_groups` hold the model's own parameters (bf16 or
fp16, batch norm's FP32 ones), never a copy or a placeholder, and `optimizer.state` is what
torch's step would keep, made when torch's would be (a parameter's first step): its moments in
their form (forms.py) and its step count. A cast parameter's FP32 value is its weight and its
rest (rows.py: FP32 masters for fp16 models, bf16 weights with int16 remainders (exact) or int8
corrections (compact)), held here; `optimizer.state_dict()` adds each rest to its parameter's
entry (optimizer_state.py), so that a checkpoint, and torch's distributed checkpoint
(`get_state_dict` / `set_state_dict`, whose template torch's own first-step call makes), carry
them under the model's names.

Gradients: scale_loss's exit leaves a cast parameter's gradient in low precision and still
scaled, checked (`keep`), and the step unscales it as it reads it; an accumulation over blocks,
or a reader, makes FP32 master gradients (`grads`, `materialize`). `amp.master_params` hands out
FP32 values (rows.lend) carrying those gradients: what a clipping leaves on them is what the step
uses. A step makes the state of the parameters stepped for the first time (zero moments, step 0:
what torch's first step finds), only once it is known to be taken, and changes nothing where it
refuses a group; a step skipped on the device changes no bit.

Under FSDP2 (shards.py) the parameters, rests, moments and gradients are DTensors of each rank's
shard: the kernels take their local shards (`sharded`), and each shard's start in its whole
tensor, from which a second moment's stochastic rounding is drawn (distributed.shard_start).
"""

import threading
import weakref

import torch

from .. import distributed, kernels
from .._state import amp_state
from .columns import NONES, consume, repeat
from .forms import check_entry
from .rows import Rows

__all__ = ["Kept", "StateOwner"]


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
        self.grads = {}  # {row: its FP32 master gradient (unscaled)}
        self.kept = None  # Kept, or None
        # A block's fresh gradients stay in the model's `.grad`, unscaled in place: a bf16
        # model's (the power-of-two unscale is exact in bf16, and the step reads them as they
        # are: a clipping of the model's or the param groups' gradients is what it steps). An
        # fp16 model's are made FP32 master gradients (unscaled in fp16 they would lose the
        # small ones) or, on the CuPy kernels, kept scaled for the step (`keep`).
        self.grads_in_model = form.master.dtype is torch.bfloat16
        # {row: the FP32 value amp.master_params handed out}: what is on it at the step (what a
        # clipping left there, or None) is the gradient stepped; held until that step
        self.handed = {}
        # {row: a weak reference to it}: while someone holds it, each exit puts the row's new FP32
        # master gradient on it (a list of master params taken once clips every step)
        self._handed_weak = {}
        self._handed_from = {}  # {row: the gradient its value's was made from}
        # The thread that trains (amp.initialize's): the gradients are its step's, and only its
        # amp.master_params hands them out (another thread's reads the values alone).
        self.thread = threading.get_ident()
        self.copies = {}  # {row: (the model's .grad amp placed as a copy, its version)}
        # Some rows are DTensors (FSDP2's shards): the kernels take their local shards
        self.sharded = False

    # -- the rows --------------------------------------------------------------------------------

    def add(self, param, rest=None):
        """A row for the cast parameter `param`: FP32 (initialize; it becomes its weight, amp's
        write), or low precision with its `rest` (one that joins from the frozen rows)."""
        with torch.no_grad():
            grad, param.grad = param.grad, None  # its FP32 master gradient, made before the cast
            if grad is not None:
                grad = grad.detach().float()
            if rest is None:
                low, rest = self.form.encode(param.detach().float())
                distributed.set_data(param, low)
        self.sharded = self.sharded or distributed.has_dtensors((param,))
        self.rest_list.append(rest)
        row = self._add(param)
        if grad is not None:
            self.grads[row] = grad
        self.mark_row(row)
        amp_state.owners[id(param)] = self
        return row

    def follow(self, row):
        """The row's rest, optimizer state and FP32 gradient onto its parameter's device (the
        model moved), as torch's load_state_dict puts a state on its parameter's device."""
        super().follow(row)
        param = self.params[row]
        entry = self.optimizer.state.get(param)
        if entry:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    entry[key] = value.to(param.device)
        if row in self.grads:
            self.grads[row] = self.grads[row].to(param.device)

    def convert_state(self, param, index):
        """`param`'s state entry, as loaded before amp.initialize (torch's format, any form, the
        dtypes torch's load cast), in this form; the master's rest is made from the parameter."""
        state = self.optimizer.state
        entry = state.get(param)
        if entry:
            in_form = self.state_form.in_form(param, id(param) in self.index)
            check_entry(entry, param, index)
            converted = self.state_form.from_torch(entry, param, in_form)
            entry.clear()
            entry.update(converted)
        if param in state and not state[param]:  # a rest alone (the parameter's value holds it)
            del state[param]

    # -- the parameters, the gradients ------------------------------------------------------------

    def plain(self, groups):
        """The parameters of `groups` with no row (FP32 ones kept FP32, batch norm's)."""
        index = self.index
        return [p for group in groups for p in group["params"] if id(p) not in index]

    def master_grads(self):
        return list(map(self.grads.get, range(len(self.params))))

    def set_master_grads(self, rows, grads):
        consume(map(self.grads.__setitem__, rows, grads))

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
        grads = [self.grads[row] for row in rows]
        if self.sharded:  # DTensors have no foreach copy: their local shards do
            torch._foreach_copy_(distributed.shards(copies), distributed.shards(grads))
        else:
            torch._foreach_copy_(copies, grads)
        for row, param, copy in zip(rows, params, copies):
            param.grad = copy
            self.copies[row] = (copy, copy._version)

    def open_block(self):
        """A scale_loss block opens: kept gradients made FP32 (they join the accumulation); the
        model's copies of FP32 master gradients let go (a written one is the master gradient
        now)."""
        self.materialize()
        written = {row for row in self.copies if self._copy_written(row)}
        copies, self.copies = self.copies, {}
        for row in copies:
            param = self.params[row]
            if row not in written:
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
        sources, destinations = kept.grads, fresh
        if self.sharded:  # the kernels take FSDP2's local shards
            sources, destinations = distributed.shards(sources), distributed.shards(fresh)
        kernels.unscale_to_(sources, destinations, kept.inv_scale, scratch, check=False)
        grads = self.grads
        for row, grad in zip(kept.rows, fresh):
            grads[row] = grad

    def drop_grads(self, zero=False):
        """The master gradients go (a step, a skip, zero_grad), a bf16 model's with its `.grad`;
        `zero`: they are zeroed and stay (zero_grad(set_to_none=False): a parameter unused in the
        next step is stepped with its zero gradient, as torch steps it)."""
        if zero:
            self.materialize()
            for grad in self.grads.values():
                grad.zero_()
            for param in self.params:
                if param.grad is not None:
                    param.grad.detach_()
                    param.grad.zero_()
        else:
            self.kept, self.grads = None, {}
            consume(map(setattr, self.params, repeat("grad"), NONES))
        self.copies = {}
        if self.handed:  # amp.master_params' values carried them
            for value in self.handed.values():
                value.grad = None
            self.handed, self._handed_from = {}, {}

    def sources(self):
        """Each row's gradient for the step: what amp.master_params' value carries; else the
        model's `.grad` where there is no FP32 master gradient or it was written since amp made
        it the master gradient's copy; else the FP32 master gradient (kept ones apart)."""
        grads = self._model_sources()
        made_from = self._handed_from
        for row, value in self.handed.items():
            if grads[row] is made_from.get(row):  # no gradient came since it was handed out
                grads[row] = value.grad
        return grads

    def _model_sources(self):
        """sources without amp.master_params' values."""
        params = self.params
        grads = list(map(self.grads.get, range(len(params))))
        for row, grad in enumerate(grads):
            model = params[row].grad
            if grad is None:
                grads[row] = model
            elif model is not None and self._copy_written(row):
                grads[row] = model
        return grads

    def _copy_written(self, row):
        """Whether the row's model `.grad` is not the copy amp placed of its FP32 master gradient
        as amp left it (another tensor, or the copy written)."""
        model, copy = self.params[row].grad, self.copies.get(row)
        if copy is None or model is not copy[0] or model._version != copy[1]:
            return True
        # A DTensor's in-place foreach ops (torch's clip_grad_norm_) bump no version counter,
        # of the DTensor or of its shard: its values tell.
        return self.sharded and not torch.equal(
            distributed.local(model), distributed.local(self.grads[row]).to(model.dtype)
        )

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
        sources = self._model_sources()
        values = []
        for row in rows:
            value = self.handed[row] = self.lend(row)
            self._handed_weak[row] = weakref.ref(value)
            grad = self._handed_from[row] = sources[row]
            value.grad = None if grad is None else grad.float()
            if self.sharded and value.grad is self.grads.get(row):
                # its model copy is checked against it by value (_copy_written): a clipping
                # through the value leaves it as it is
                value.grad = value.grad.clone()
            values.append(value)
        return values

    def held_grads(self):
        """[(parameter, the gradient the step would take or None)] of every row, in row order
        (the same list on every rank: a skip's report is a collective)."""
        held = self.sources()
        kept = self.kept
        if kept is not None:
            for row, grad in zip(kept.rows, kept.grads):
                held[row] = grad
        return list(zip(self.params, held))

    def master_params(self):
        """What amp.master_params yields: for each parameter of the groups, its FP32 value lent
        (rows.lend) with its FP32 master gradient on it, or a plain parameter itself. In another
        thread than the one that trains, the values without gradients: handing a gradient out
        makes it (from kept scaled ones) and notes it for the step, the training thread's own."""
        index = self.index
        groups = self.optimizer.param_groups
        params = [p for group in groups for p in group["params"]]
        rows = [index.get(id(p)) for p in params]
        if threading.get_ident() != self.thread:  # a reader's: the values, lent, no gradient
            return [param if row is None else self.lend(row) for param, row in zip(params, rows)]
        values = iter(self._hand([row for row in rows if row is not None]))
        return [param if row is None else next(values) for param, row in zip(params, rows)]

    # -- undo ---------------------------------------------------------------------------------

    def give_back(self):
        """deinitialize (after the model has its FP32 weights back): every state entry in
        torch's FP32 format, its step count where torch's step keeps it; the master gradients
        on the FP32 parameters."""
        self.materialize()
        for row, param in enumerate(self.params):
            grad = self.grads.get(row)
            if grad is not None and param.dtype is torch.float32:
                param.grad = grad
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
        self.kept, self.grads = None, {}
