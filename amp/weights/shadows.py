"""FP32 state dicts of a cast model at O2/O3: live FP32 values behind the low-precision tensors.

At O2 every cast parameter has an FP32 copy in a table (amp/weights/table.py): its master when an
optimizer steps it, an FP32 copy in the table of frozen parameters when none does. At O2/O3 every
cast floating buffer keeps its FP32 original as its shadow here; one whose values the low
precision holds exactly (a causal mask of 0 and -inf, integer positions) keeps the original's
object only, its memory released, until a state dict or a load needs the FP32 values apart
(`Shadow.exact`), so that O2 holds such a buffer once, in low precision. O3 keeps no FP32 copy
of its parameters: `state_dict()` makes a transient shadow, which lives until the next forward
has taken what was written into it. `model.state_dict()` returns the FP32 tensors themselves, so
that code which updates a model in place through its state dict (timm's ModelEmaV2/V3 on a
`copy.deepcopy` of the model) changes what the model computes with: a write into an FP32 value
is copied into the low-precision tensor before the next forward, and a write into the
low-precision tensor is taken into the FP32 value where it changed the low-precision value
(table.py says how).

Parameters are found by identity, wherever they sit: one that `torch.nn.utils.parametrize` or
`torch.nn.utils.prune` moved (to `<module>.parametrizations.<name>.original`, `<name>_orig`) is
served under its new key, and a load under that key reaches its FP32 value. Each hook handles its
module's own tensors and those of the submodules made after `amp.initialize` (which have no hooks
of their own), so a state dict of any module is FP32 throughout.

The hooks hold everything they read (picklable module-level classes), so a deepcopy or a pickle
of the model carries its own FP32 values along.
"""

import sys
import types

import torch

from ..casting.casts import LOW_PRECISION
from .table import find

__all__ = [
    "held_exactly",
    "Shadow",
    "ModelShadows",
    "SyncBeforeForward",
    "FP32StateDict",
    "LoadIntoShadows",
    "MarkLoaded",
]

_DATA = torch.Tensor.data_ptr  # `param.data = t` keeps the version counter: the storage tells


class Shadow:
    """One low-precision buffer (or, at O3, a parameter a state dict handed out) of `module`
    under `name`, and its FP32 copy."""

    def __init__(self, module, name, is_param, fp32, exact=False):
        self.module = module
        self.name = name
        self.is_param = is_param
        self.fp32 = fp32
        # The low-precision tensor holds the FP32 values exactly: `fp32` is the original object
        # with its memory released, filled again (full) when the values are needed apart.
        self.exact = exact
        self.low = None  # the low-precision tensor last synced
        self.low_version = self.fp32_version = None
        self.low_data = None  # where the low-precision tensor's data was (`param.data = ...`)
        # Only what is seen to have changed is taken from the low-precision side: a write that
        # rounds to the same value (a `clamp_` that clamps nothing) leaves the FP32 value alone.

    def current(self):
        tensors = self.module._parameters if self.is_param else self.module._buffers
        return tensors.get(self.name)

    def __getstate__(self):
        # A copy of the model (deepcopy, pickle) has new tensors, whose version counters start
        # anew: it keeps whether each side was written since the mark, not the counts, so that
        # a write not yet taken over is taken over in the copy as in the original.
        state = self.__dict__.copy()
        low = self.low
        state["low_version"] = (
            low is not None and low._version == self.low_version and _DATA(low) == self.low_data
        )
        state["fp32_version"] = self.fp32._version == self.fp32_version
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        clean_low, clean_fp32 = state["low_version"] is True, state["fp32_version"] is True
        self.low_version = self.low._version if clean_low else None  # None: written since
        self.low_data = _DATA(self.low) if clean_low else None
        self.fp32_version = self.fp32._version if clean_fp32 else None

    def mark(self):
        """The two sides agree now (amp wrote one from the other)."""
        self.low = self.current()
        self.low_version = None if self.low is None else self.low._version
        self.low_data = None if self.low is None else _DATA(self.low)
        self.fp32_version = self.fp32._version

    def release(self):
        """Release the FP32 original of an exact shadow where nothing else holds it or its memory
        (a module kept FP32, another model, an alias, a view would see it empty) and torch owns
        that memory (not numpy's, shared or from DLPack: released, it would stop being shared);
        else it stays as it is, and the shadow an ordinary one."""
        if self.exact:
            storage = self.fp32.untyped_storage()
            owned = storage.resizable() and not storage.is_shared()
            del storage  # it would count as a use of the storage
            alone = _ALONE is not None and _references(self) == _ALONE
            if owned and alone and self.fp32._base is None:
                self.fp32.data = torch.empty(0, device=self.fp32.device)
            else:
                self.exact = False

    def full(self):
        """The FP32 tensor, its values made from the low-precision tensor if it held them."""
        if self.exact:
            low = self.current()
            if low is not None:
                self.fp32.data = low.detach().float()  # the original object: its identity kept
            self.exact = False
            self.mark()
        return self.fp32

    def push(self):
        """Copy a write into the FP32 side (through a state dict) to the low-precision tensor."""
        if self.fp32._version != self.fp32_version:
            self.sync()

    def sync(self):
        """Copy a write made since the last sync across; the FP32 side wins a conflict."""
        low = self.current()
        if low is None or low.dtype not in LOW_PRECISION:
            return  # removed, or replaced by an FP32 tensor: nothing to shadow
        if self.exact:  # the FP32 values are the low-precision tensor's, whatever was written
            if low is not self.low:  # a new tensor was assigned: it is the value (a new object)
                self.fp32, self.exact = low.detach().float(), False
            self.mark()
            return
        with torch.no_grad():
            if low is not self.low or low.shape != self.fp32.shape:
                self.fp32 = low.detach().float()  # a new tensor was assigned: it is the value
            elif self.fp32._version != self.fp32_version:
                low.copy_(self.fp32)
            elif (
                low._version != self.low_version or _DATA(low) != self.low_data or not self.is_param
            ):
                # A buffer is compared every time: batch norm updates its running statistics
                # without bumping their version counter.
                changed = low != self.fp32.to(low.dtype)
                self.fp32.copy_(torch.where(changed, low.float(), self.fp32))
        self.mark()


class ModelShadows:
    """What the state-dict hooks of one model read: the tables of the parameters (shared by every
    model of one initialize), the shadows of its buffers and the transient ones of O3, and the
    modules that have hooks of their own."""

    def __init__(self, tables):
        self.tables = tables  # the optimizers' tables and the frozen parameters' table
        self.buffers = {}  # module -> {name: Shadow}
        self.transients = {}  # module -> {name: Shadow} (O3, until the next forward)
        self.hooked = set()  # the modules amp registered the hooks on
        self.lent = False  # a state dict handed out FP32 tensors: they may be written any time

    def walk(self, module, prefix):
        """(module, prefix) for `module` and its submodules that have no hooks of their own."""
        found = [(module, prefix)]
        for name, child in module._modules.items():
            if child is not None and child not in self.hooked:
                found.extend(self.walk(child, f"{prefix}{name}."))
        return found

    def sync(self):
        """Every write since the last mark taken across (before deinitialize's undo)."""
        for table in self.tables:
            table.take_outside_writes()
        for by_name in list(self.buffers.values()) + list(self.transients.values()):
            for shadow in by_name.values():
                shadow.sync()

    def push(self):
        """Writes into the FP32 side reach the model; O3's transient shadows go."""
        for table in self.tables:
            table.push_written_masters()
        for by_name in list(self.buffers.values()) + list(self.transients.values()):
            for shadow in by_name.values():
                shadow.push()
        self.transients = {}


class SyncBeforeForward:
    """Forward pre-hook: writes made through a state dict reach the model before it computes."""

    def __init__(self, model_shadows):
        self.model_shadows = model_shadows

    def __call__(self, module, args):
        if self.model_shadows.lent:
            self.model_shadows.push()


class FP32StateDict:
    """State-dict post-hook: the low-precision entries of a module as their FP32 values."""

    def __init__(self, model_shadows):
        self.model_shadows = model_shadows

    def __call__(self, module, state_dict, prefix, local_metadata):
        shadows = self.model_shadows
        for owner, owner_prefix in shadows.walk(module, prefix):
            for name, param in owner._parameters.items():
                value = state_dict.get(owner_prefix + name)
                if _low(value, param):
                    state_dict[owner_prefix + name] = self._param_value(owner, name, param)
            for name, buffer in owner._buffers.items():
                value = state_dict.get(owner_prefix + name)
                if _low(value, buffer):
                    shadow = shadows.buffers.get(owner, {}).get(name)
                    if shadow is None:
                        state_dict[owner_prefix + name] = value.float()  # made after initialize
                        continue
                    shadow.sync()
                    state_dict[owner_prefix + name] = shadow.full().detach()
                    shadows.lent = True

    def _param_value(self, owner, name, param):
        shadows = self.model_shadows
        table, row = find(param, shadows.tables)
        shadows.lent = True
        if table is not None:
            table.sync_row(row)
            return table.masters[row].detach()  # shares the version counter: writes show
        transients = shadows.transients.setdefault(owner, {})
        shadow = transients.get(name)
        if shadow is None or shadow.current() is not param:
            shadow = transients[name] = Shadow(owner, name, True, param.detach().float())
            shadow.mark()
        shadow.sync()
        return shadow.fp32.detach()


def _low(value, tensor):
    """Whether a state-dict entry is a low-precision value to replace (not a live Parameter
    kept by keep_vars=True, not absent, not already FP32)."""
    return value is not None and value is not tensor and value.dtype in LOW_PRECISION


class LoadIntoShadows:
    """Load-state-dict pre-hook: full-precision values go into the FP32 copies, not only into the
    model (whose own load rounds them)."""

    def __init__(self, model_shadows):
        self.model_shadows = model_shadows

    def __call__(self, module, state_dict, prefix, *args):
        shadows = self.model_shadows
        with torch.no_grad():
            for owner, owner_prefix in shadows.walk(module, prefix):
                for name, param in owner._parameters.items():
                    table, row = find(param, shadows.tables)
                    if table is not None:
                        table.sync_row(row)  # a write not yet taken over is not lost to a load
                        _load(table.masters[row], state_dict.get(owner_prefix + name))
                for name, shadow in shadows.buffers.get(owner, {}).items():
                    shadow.sync()
                    value = state_dict.get(owner_prefix + name)
                    if not (shadow.exact and _held_exactly(value, shadow.current())):
                        _load(shadow.full(), value)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # None: nothing is released


def _references(holder):
    """(Python references, uses of its storage) of `holder.fp32`, counted from here."""
    tensor = holder.fp32
    if _USE_COUNT is None:
        return None
    return sys.getrefcount(tensor), _USE_COUNT(tensor.untyped_storage()._cdata)


# What _references counts for a tensor that its holder alone holds (measured, not assumed: how
# many references the interpreter's stack adds differs between Python versions).
_ALONE = _references(types.SimpleNamespace(fp32=torch.zeros(1)))


def held_exactly(fp32, dtype):
    """Whether `dtype` holds every value of the FP32 tensor `fp32` bit for bit (False for a
    tensor without values to compare: meta, fake, or a subclass)."""
    if type(fp32) is not torch.Tensor or fp32.device.type == "meta":
        return False
    bits = torch.int32
    return torch.equal(fp32.to(dtype).float().view(bits), fp32.detach().view(bits))


def _held_exactly(value, low):
    """Whether the model's own load of `value` into the low-precision `low` keeps every bit."""
    return (
        isinstance(value, torch.Tensor)
        and low is not None
        and value.shape == low.shape
        and value.dtype is torch.float32
        and held_exactly(value, low.dtype)
    )


def _load(fp32, value):
    if isinstance(value, torch.Tensor) and value.shape == fp32.shape:
        fp32.copy_(value)


class MarkLoaded:
    """Load-state-dict post-hook: what was just loaded is amp's own write, not an outside one."""

    def __init__(self, model_shadows):
        self.model_shadows = model_shadows

    def __call__(self, module, incompatible_keys):
        shadows = self.model_shadows
        for owner, _ in shadows.walk(module, ""):
            for param in owner._parameters.values():
                table, row = find(param, shadows.tables)
                if table is not None:
                    table.mark_row(row)
            for shadow in shadows.buffers.get(owner, {}).values():
                shadow.mark()
