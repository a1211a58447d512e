"""Where an inf or NaN started: armed by a skipped step, for the next step only.

Nothing is installed until a step is skipped. Then amp adds two process-wide module hooks
(`torch.nn.modules.module.register_module_forward_pre_hook` / `..._forward_hook`), so it sees
every module the next iteration calls: the models given to `amp.initialize` and, for
`amp.GradScaler`, which has no model list, whatever model the loop runs. In that iteration:

- forward: every module's output is checked, in the order the modules finish (a child
  before its parent), so the first non-finite output is the innermost module that made it;
- backward: tensor hooks on each module's direct parameters and floating inputs (the
  gradients its backward produces) and on the outputs of the outermost modules (the gradient
  the loss computation produces), checked in the order autograd computes them.

Tensor hooks rather than module backward hooks: those wrap a module's outputs in a view, and a
later in-place op on them (``ReLU(inplace=True)``) then raises, in the user's step.

Every check leaves a flag on the device; the flags are read together (one sync per device) at
the next optimizer step, which removes every hook first. A model's name for a module is the one
`named_modules()` gives in the model passed to `amp.initialize` (so a DDP wrapper adds no
``module.`` prefix), else in the outermost module the call came through.
"""

import contextlib
import dataclasses
import threading
import weakref
from typing import Optional

import torch
from torch.nn.modules import module as nn_module

from .._state import amp_state
from ..patching import ORIGINAL_ATTRIBUTE

__all__ = ["Origin", "OriginWatch"]

_KEEP = 64  # (flag, origin) pairs kept for the skip reports that read them
_HELD = 4096  # checks held before they are read without a step (a watch no step ends)


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where the first inf or NaN of a step appeared."""

    module: Optional[str]  # qualified name as in named_modules(); None: outside every module
    phase: str  # "forward" or "backward"
    op: str  # the module's class (or "loss" for a non-finite loss outside every module)
    dtype: Optional[torch.dtype]
    kind: str  # "inf" or "nan" ("inf" when both: a NaN usually follows from an inf)

    def __str__(self):
        """Where, for messages: "the output of module 'body.lin' in forward (Linear, float16,
        inf)"."""
        if self.module is None and self.phase == "forward":
            place = "the loss itself, outside every module"
        elif self.module is None:
            place = "the gradient the loss computation sends into the model"
        elif self.phase == "forward":
            place = f"the output of module {self.module!r} in forward"
        else:
            place = f"a gradient of module {self.module!r} in backward"
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        return f"{place} ({self.op}, {dtype}, {self.kind})"


def _floating(value, found):
    """The floating-point tensors in `value`, looking inside lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _floating(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _floating(item, found)
    return found


def _torch_stack(tensors):
    # torch's own stack, not amp's O1 wrapper: amp's checks stay out of the user's amp.trace()
    return getattr(torch.stack, ORIGINAL_ATTRIBUTE, torch.stack)(tensors)


def _flag(tensors):
    """A bool[2] device tensor: (any inf, any NaN) over `tensors`. No sync."""
    with torch.no_grad():
        flags = [_torch_stack((t.isinf().any(), t.isnan().any())) for t in tensors]
        flag = flags[0]
        for other in flags[1:]:
            flag = flag | other.to(flag.device)
    return flag


class _Site:
    """Who a hooked tensor's gradient is charged to (a later consumer module may take it over)."""

    __slots__ = ("module", "op")

    def __init__(self, module, op):
        self.module, self.op = module, op


class OriginWatch:
    """The hooks of one armed step and the checks they made, in the order they ran."""

    def __init__(self):
        self.armed = False
        self.fired = False  # some hook ran since arming: the watched step has begun
        self._handles = []
        self._events = []  # (module name, phase, op, dtype, flag tensor)
        self._names = {}  # module -> qualified name
        self._hooked_params = set()
        self._sites = {}  # id(tensor) -> (weak reference, _Site), for the hooked tensors
        self._local = threading.local()  # the stack of modules being called, per thread
        # Owners are held weakly: a GradScaler dropped after its last step skipped (the end of
        # a training run) must not leave the process-wide hooks behind for nobody.
        self._waiting = weakref.WeakSet()  # the owners whose next step this watch is for
        self._stepped = weakref.WeakSet()  # the owners that stepped since the watched step began
        self._next = []  # owners that skipped during the watched step: they arm the next one
        self._found = []  # (overflow flag, Origin or None) of the last watched steps
        self._paused = 0  # > 0: what runs now is not the user's step (amp.audit's forwards)

    # -- arming and disarming -------------------------------------------------------------

    def arm(self, owner):
        """Watch the next step of `owner` (an optimizer's record, or a GradScaler) that skipped.

        A skip during a watched step arms the step after it, once this watch has ended.
        """
        if self.armed and not self._waiting:
            self.disarm()  # every owner it waited for is gone: nobody would read it
        if self.armed and self.fired:
            self._next.append(weakref.ref(owner))
            return
        if not self.armed:
            self._install()
        self._waiting.add(owner)

    def _install(self):
        self.armed = True
        self.fired = False
        self._names = {}
        for model in amp_state.models:  # the names amp's user knows, even under a wrapper
            for name, module in model.named_modules():
                self._names.setdefault(module, name)
        self._handles.append(nn_module.register_module_forward_pre_hook(self._before))
        self._handles.append(nn_module.register_module_forward_hook(self._after, always_call=True))

    def disarm(self):
        """Remove every hook this watch added and forget what it saw (and who waits for it)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._events = []
        self._names = {}
        self._hooked_params = set()
        self._sites = {}
        self._local = threading.local()
        self._waiting = weakref.WeakSet()
        self._stepped = weakref.WeakSet()
        self._next = []
        self.armed = False
        self.fired = False

    def settle(self, owner, flags=()):
        """At a step of `owner`: where the first inf/NaN of the watched step was, or None.

        Owners that armed the watch read what it saw so far (their forward and backward have
        run), and it ends (every hook goes) once all of them have stepped, or once some other
        owner steps a second time (a whole iteration has passed). `flags`: the owner's overflow
        flags of this step, whose skip reports take the origin. Before the watched step ran, or
        for an owner that did not arm it, returns None and reads nothing.
        """
        if not (self.armed and self.fired):
            return None
        found = None
        if owner in self._waiting:
            self._waiting.discard(owner)
            found = _first_nonfinite(self._events)
            self._found = (self._found + [(flag, found) for flag in flags])[-_KEEP:]
        elif owner in self._stepped:
            self._waiting = weakref.WeakSet()
        self._stepped.add(owner)
        if not self._waiting:
            following = [waiting() for waiting in self._next]
            self.disarm()
            for waiting in following:
                if waiting is not None:
                    self.arm(waiting)
        return found

    def watched(self, flag):
        """Whether the step whose overflow flag is `flag` was a watched one."""
        return any(candidate is flag for candidate, _ in self._found)

    def origin_for(self, flag):
        """The origin found for the step whose overflow flag is `flag`, or None."""
        for candidate, origin in self._found:
            if candidate is flag:
                return origin
        return None

    @contextlib.contextmanager
    def paused(self):
        """Nothing that runs inside is watched: amp.audit's forwards are not the user's step."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- what the hooks record ------------------------------------------------------------

    def note_loss(self, loss):
        """scale_loss / GradScaler.scale: the loss itself, after every module's output."""
        watching = self.armed and not self._paused
        if watching and isinstance(loss, torch.Tensor) and loss.is_floating_point():
            self.fired = True
            self._record((None, "forward", "loss", loss.dtype, _flag([loss])))

    def note_cast(self, module, outputs):
        """fp32_modules at O2/O3: a kept module's outputs, cast back to the model's dtype after
        every forward hook saw them in FP32; an output beyond that dtype's range is born here."""
        tensors = _floating(outputs, [])
        if self.armed and not self._paused and tensors and not torch.compiler.is_compiling():
            name = self._names.get(module, f"<{type(module).__name__}>")
            self._record((name, "forward", type(module).__name__, tensors[0].dtype, _flag(tensors)))

    def _stack(self):
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _name(self, module, root):
        name = self._names.get(module)
        if name is None:
            for qualified, candidate in root.named_modules():
                self._names.setdefault(candidate, qualified)
            name = self._names.setdefault(module, f"<{type(module).__name__}>")
        return name

    def _before(self, module, args):
        if self._paused or torch.compiler.is_compiling():
            return
        if not self._waiting:  # its owners are gone (torch iterates a copy of the hooks)
            self.disarm()
            return
        self.fired = True
        stack = self._stack()
        name = self._name(module, stack[0] if stack else module)
        stack.append(module)
        op = type(module).__name__
        if torch.is_grad_enabled():
            for tensor in _floating(args, []):
                if tensor.requires_grad:
                    self._charge(tensor, name, op, outside=False)
            if module not in self._hooked_params:
                self._hooked_params.add(module)
                for param in module.parameters(recurse=False):
                    if param.requires_grad:
                        self._charge(param, name, op, outside=False)

    def _after(self, module, args, output):
        if self._paused or torch.compiler.is_compiling():
            return
        stack = self._stack()
        if stack and stack[-1] is module:
            stack.pop()
        tensors = _floating(output, [])
        if not tensors:
            return
        name = self._names.get(module, f"<{type(module).__name__}>")
        op = type(module).__name__
        self._record((name, "forward", op, tensors[0].dtype, _flag(tensors)))
        if not stack and torch.is_grad_enabled():  # an outermost module: the loss follows
            for tensor in tensors:
                if tensor.requires_grad:
                    self._charge(tensor, None, "loss", outside=True)

    def _record(self, event):
        self._events.append(event)
        if len(self._events) >= _HELD:
            self._read_held()

    def _read_held(self):
        """A skip on the last training step, then hours of evaluation: no step ends the watch,
        and every module call adds a check. Read those held (one sync, only here): once one
        is bad, keep it alone and stop watching (nothing later can come first); else drop
        them, and the hooks of tensors that are gone, and go on watching."""
        bad = _bad_events(self._events)
        if bad:
            first = min(bad)
            self._events = [self._events[first]]
            for handle in self._handles:
                handle.remove()
            self._handles, self._sites, self._hooked_params = [], {}, set()
            return
        self._events = []
        self._sites = {key: entry for key, entry in self._sites.items() if entry[0]() is not None}
        self._handles = [handle for handle in self._handles if handle.hooks_dict_ref() is not None]

    def _charge(self, tensor, name, op, outside):
        """Check `tensor`'s gradient when autograd computes it, charged to module `name`."""
        entry = self._sites.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            site = entry[1]
            if site.module is None and not outside:  # a module consumes a model's output
                site.module, site.op = name, op
            return
        site = _Site(name, op)
        self._sites[id(tensor)] = (weakref.ref(tensor), site)

        def check(grad):
            if grad is not None and self.armed and not self._paused:
                self._record((site.module, "backward", site.op, grad.dtype, _flag([grad])))

        self._handles.append(tensor.register_hook(check))


def _bad_events(events):
    """{index: "inf" or "nan"} of the events whose flag is set (one host read per device)."""
    by_device = {}
    for index, event in enumerate(events):
        by_device.setdefault(event[4].device, []).append(index)
    bad = {}
    for indices in by_device.values():
        values = _torch_stack([events[i][4] for i in indices]).tolist()
        for index, (inf, nan) in zip(indices, values):
            if inf or nan:
                bad[index] = "inf" if inf else "nan"
    return bad


def _first_nonfinite(events):
    """The Origin of the first event whose flag is set, or None."""
    bad = _bad_events(events) if events else None
    if not bad:
        return None
    first = min(bad)
    module, phase, op, dtype, _ = events[first]
    if module is None and phase == "backward":
        op = "loss"
    return Origin(module, phase, op, dtype, bad[first])
