"""FP32 shadows of a cast model's low-precision tensors: live FP32 state dicts at O2/O3.

At O2 every cast parameter has an FP32 shadow (its master weight when an optimizer steps it, an
FP32 copy when it is frozen), and at O2/O3 every cast floating buffer keeps its FP32 original as
its shadow. O3 keeps no FP32 copy of its parameters: `state_dict()` makes a transient shadow,
which lives until the next forward has taken what was written into it. `model.state_dict()`
returns the shadows themselves, so that code which updates a
model in place through its state dict (timm's ModelEmaV2/V3 on a `copy.deepcopy` of the model)
changes what the model computes with: a write into a shadow is copied into the low-precision
tensor before the next forward. A write into the low-precision tensor (a `param.copy_`,
DataParallel's broadcast, a `clamp_`, new data of its shape by `param.data = ...` as
torch.nn.utils.prune.remove makes) is taken into the shadow where it changed the low-precision
value, so a write that changes nothing leaves the FP32 value alone. Writes through `param.data`
in place (`param.data.clamp_(...)`) bump no version counter: they are not seen.

The shadows live in the hooks amp registers on the model (picklable module-level classes), so a
deepcopy or a pickle of the model carries its own shadows along.
"""

import operator

import torch

from ..casting.casts import LOW_PRECISION
from .grad_stash import set_each

# The per-step checks below read these over whole lists at C level (`map`), so an O2 step costs
# a constant number of Python calls however many parameters the model has.
_LOW = operator.attrgetter("low")
_LOW_VERSION = operator.attrgetter("low_version")
_FP32 = operator.attrgetter("fp32")
_FP32_VERSION = operator.attrgetter("fp32_version")
_NAME = operator.attrgetter("name")
_PARAMETERS = operator.attrgetter("module._parameters")
_VERSION = operator.attrgetter("_version")
_SHAPE = operator.attrgetter("shape")
_LOW_DATA = operator.attrgetter("low_data")
_DATA = torch.Tensor.data_ptr  # `param.data = t` keeps the version counter: the storage tells


class Shadow:
    """One low-precision tensor (`module`'s parameter or buffer `name`) and its FP32 copy."""

    def __init__(self, module, name, is_param, fp32, transient=False):
        self.module = module
        self.name = name
        self.is_param = is_param
        self.fp32 = fp32
        self.transient = transient  # made by a state dict at O3; dropped at the next forward
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
        if _lagging:
            flush()
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
        if _lagging:
            flush()  # an older batched mark must not overwrite this one later
        self.low = self.current()
        self.low_version = None if self.low is None else self.low._version
        self.low_data = None if self.low is None else _DATA(self.low)
        self.fp32_version = self.fp32._version

    def push(self):
        """Copy a write into the FP32 side (through a state dict) to the low-precision tensor."""
        if _lagging:
            flush()
        if self.fp32._version != self.fp32_version:
            self.sync()

    def sync(self):
        """Copy a write made since the last sync across; the FP32 side wins a conflict."""
        if _lagging:
            flush()
        low = self.current()
        if low is None or low.dtype not in LOW_PRECISION:
            return  # removed, or replaced by an FP32 tensor: nothing to shadow
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


def sync_params(shadows):
    """Shadow.sync for every parameter shadow in `shadows` written on either side since amp
    last synced or marked it.

    The common answer, none, comes from comparing whole lists of tensors and version counters at
    C level; only a shadow found changed is looked at on its own. The caller first writes its
    own batched marks into these shadows (ParamMarks.write); another optimizer's batch stays
    batched (a marked value older than the newest can only make a shadow look written, and a
    shadow looked at on its own writes every batch first).
    """
    currents = list(map(dict.get, map(_PARAMETERS, shadows), map(_NAME, shadows)))
    lows = list(map(_LOW, shadows))
    fp32s = list(map(_FP32, shadows))
    try:
        if (
            all(map(operator.is_, currents, lows))
            and list(map(_VERSION, lows)) == list(map(_LOW_VERSION, shadows))
            and list(map(_DATA, lows)) == list(map(_LOW_DATA, shadows))
            and list(map(_VERSION, fp32s)) == list(map(_FP32_VERSION, shadows))
            and list(map(_SHAPE, lows)) == list(map(_SHAPE, fp32s))  # `param.data = ...`
        ):
            return
    except AttributeError:  # a parameter removed (None): looked at below
        pass
    for shadow, current in zip(shadows, currents):
        if (
            current is None
            or current is not shadow.low
            or current._version != shadow.low_version
            or _DATA(current) != shadow.low_data
            or shadow.fp32._version != shadow.fp32_version
            or current.shape != shadow.fp32.shape
        ):
            shadow.sync()


# Batched marks not yet written into their shadows, oldest first (a dict as an ordered set:
# membership and order at C level, no id() call).
_lagging = {}


def flush():
    """Write every batched mark into its shadows, oldest first. Runs before a shadow is looked at
    or marked on its own, so that each Shadow reads as if it had been marked at the time."""
    books = list(_lagging)
    _lagging.clear()
    for book in books:
        book.write_out()


class ParamMarks:
    """The marks of one optimizer's parameter shadows (in master-pair order), made in a batch.

    amp writes every master into its model parameter at each step. Marking each Shadow after that
    costs three setattr a parameter, and checking them before the next step a dozen reads a
    parameter. A batch keeps the version counters as lists instead, and `unchanged` compares
    them as lists; they are written into the shadows (`flush`) only when a shadow is looked at on
    its own: a state dict, a load, or a step that found a write from outside amp.
    """

    __slots__ = (
        "shadows",
        "lows",
        "fp32s",
        "dicts",
        "names",
        "shapes",
        "low_versions",
        "low_datas",
        "fp32_versions",
    )

    def __init__(self):
        self.shadows = None

    def mark(self, shadows, lows):
        """Shadow.mark for `shadows`, whose parameters are `lows` (parallel lists), in a batch."""
        if self.shadows is not shadows or self not in _lagging:
            # First, or flushed since (something was looked at on its own): take it all anew.
            self.shadows = shadows
            self.lows = list(lows)
            self.fp32s = list(map(_FP32, shadows))
            self.dicts = list(map(_PARAMETERS, shadows))
            self.names = list(map(_NAME, shadows))
            self.shapes = list(map(_SHAPE, self.lows))
        self.low_versions = list(map(_VERSION, self.lows))
        self.low_datas = list(map(_DATA, self.lows))
        self.fp32_versions = list(map(_VERSION, self.fp32s))
        _lagging.pop(self, None)
        _lagging[self] = None  # the newest batch is written last

    def write(self):
        """Write this batch alone into its shadows, if it still waits (before a sync_params)."""
        if self in _lagging:
            del _lagging[self]
            self.write_out()

    def write_out(self):
        shadows = self.shadows
        set_each(shadows, "low", self.lows)
        set_each(shadows, "low_version", self.low_versions)
        set_each(shadows, "low_data", self.low_datas)
        set_each(shadows, "fp32_version", self.fp32_versions)

    def unchanged(self, shadows):
        """True when neither side of any of `shadows` was written, replaced or moved since this
        batch marked them (and nothing flushed it since): sync_params would find nothing."""
        return (
            self.shadows is shadows
            and self in _lagging
            and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.lows))
            and list(map(_VERSION, self.lows)) == self.low_versions
            and list(map(_DATA, self.lows)) == self.low_datas
            and list(map(_VERSION, self.fp32s)) == self.fp32_versions
            and list(map(_SHAPE, self.lows)) == self.shapes  # `param.data = ...`
        )


class ModelShadows:
    """The shadows of one model; `lent` once a state dict handed them out."""

    def __init__(self):
        self.shadows = []
        self.lent = False

    def sync(self):
        for shadow in self.shadows:
            shadow.sync()

    def add_transient(self, by_name, name, low, module):
        shadow = by_name[name] = Shadow(module, name, True, low.detach().float(), transient=True)
        shadow.mark()
        self.shadows.append(shadow)
        return shadow

    def drop_transients(self, by_module):
        if any(shadow.transient for shadow in self.shadows):
            for shadow in self.shadows:
                if shadow.transient:
                    del by_module[shadow.module][shadow.name]
            self.shadows = [shadow for shadow in self.shadows if not shadow.transient]


class SyncBeforeForward:
    """Forward pre-hook: writes made through a state dict reach the model before it computes."""

    def __init__(self, model_shadows, by_module):
        self.model_shadows = model_shadows
        self.by_module = by_module  # module -> {name: Shadow}, shared with the other hooks

    def __call__(self, module, args):
        if self.model_shadows.lent:
            for shadow in self.model_shadows.shadows:
                shadow.push()
            self.model_shadows.drop_transients(self.by_module)


class FP32StateDict:
    """State-dict post-hook of one module: its low-precision entries as FP32 shadows."""

    def __init__(self, model_shadows, by_name):
        self.model_shadows = model_shadows
        self.by_name = by_name  # name -> Shadow for this module

    def __call__(self, module, state_dict, prefix, local_metadata):
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            key = prefix + name
            value = state_dict.get(key)
            if value is None or value is tensor or value.dtype not in LOW_PRECISION:
                continue  # absent, kept as a live Parameter (keep_vars=True), or already FP32
            shadow = self.by_name.get(name)
            if shadow is None:
                if name not in module._parameters:
                    state_dict[key] = value.float()  # a buffer made after initialize
                    continue
                shadow = self.model_shadows.add_transient(self.by_name, name, tensor, module)
            shadow.sync()
            state_dict[key] = shadow.fp32.detach()  # shares the version counter: writes show
            self.model_shadows.lent = True


class LoadIntoShadows:
    """Load-state-dict pre-hook: full-precision values go into the shadows, not only the model."""

    def __init__(self, by_name):
        self.by_name = by_name

    def __call__(self, module, state_dict, prefix, *args):
        with torch.no_grad():
            for name, shadow in self.by_name.items():
                shadow.sync()  # a write not yet taken over is not lost to a partial load
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == shadow.fp32.shape:
                    shadow.fp32.copy_(value)


class MarkLoaded:
    """Load-state-dict post-hook: what was just loaded is amp's own write, not an outside one."""

    def __init__(self, by_name):
        self.by_name = by_name

    def __call__(self, module, incompatible_keys):
        for shadow in self.by_name.values():
            shadow.mark()
