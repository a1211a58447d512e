"""The patch set: the torch functions and Tensor methods on which amp's tables (and registrations)
decide otherwise than torch's own autocast (lists/agreement.py), torch.autocast's enter and exit
and the backward entry (torch_autocast.py), and TorchScript's resolvers.

O1 and autocast regions share it. It is installed when amp first casts (an O1 `initialize`, or
the first region) and stays installed, so a region costs a state change rather than hundreds of
`setattr`s; outside amp's casting every wrapper calls its original at once. While an amp.trace()
block is open the set holds every table entry (a trace records every call the tables decide).
`amp.deinitialize()` removes it (when the last open region exits, if one is open), after which
every torch attribute is the original object again. Replacement functions are built once and
reused.
"""

import functools
import logging

from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import lists
from .._state import amp_state
from ..lists import agreement
from . import signatures, torch_autocast, torchscript
from ..patching import PatchLedger
from .float8_wrapper import make_float8_wrapper
from .wrappers import deciders_for, make_wrapper

__all__ = ["logger", "TorchPatches"]

logger = logging.getLogger("amp")


def _prime_dynamo():
    """Have torch.compile build its tables of torch's functions now, from the originals, before
    amp's patches replace them. Dynamo reads them from their modules and keys its rules by
    identity: built while amp's patches are installed, the table names amp's wrappers and lacks
    the originals they call, so every patched call breaks the graph (`fullgraph=True` fails).
    It builds them on first use and rebuilds them after `init_process_group` clears them, so
    this runs at every install (cached, it costs nothing); the first pays Dynamo's import (a
    second or two) where nothing imported it before."""
    global _no_dynamo
    if _no_dynamo:
        return
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # a torch without Dynamo: nothing to prime
        _no_dynamo = True
        return
    trace_rules.get_torch_obj_rule_map()
    trace_rules.get_tensor_method()


_no_dynamo = False


class TorchPatches:
    def __init__(self):
        self._kept = False  # installed by an earlier user: stays until drop()
        self._ledger = None
        self._built = {}  # (namespace object id, name) -> AttributePatch, reused across installs
        self._plan_cache = None
        # The FLOAT8_FUNCS get their FP8 wrappers once a policy asks for float8 (use_float8),
        # until the patches are removed: F.linear pays for no float8 check in runs without it.
        self.float8 = False
        self.tracing = False  # built for open amp.trace() blocks: every table entry wrapped

    @property
    def installed(self):
        return self._ledger is not None

    @property
    def users(self):
        """Open regions and O1 initializations holding the patches now."""
        return len(amp_state.patch_users)

    def acquire(self):
        """A user (a region, O1) holds the patches from now, installed if they are not."""
        amp_state.patch_users.append(None)  # a user first: drop() then leaves the patches be
        amp_state.active = True
        if self._ledger is None or not self._kept:
            self._keep()

    def _keep(self):
        """Install the patches if they are not, and keep them until drop()."""
        with amp_state.lock:
            self._kept = True
            if self._ledger is None:
                try:
                    self._install()
                except BaseException:
                    amp_state.patch_users.pop()
                    amp_state.refresh_active()
                    raise

    def release(self):
        """A user lets the patches go."""
        users = amp_state.patch_users
        try:
            users.pop()
        except IndexError:
            raise RuntimeError(
                "amp's torch patches were released more often than acquired"
            ) from None
        if users:
            return
        # The last user let the patches go: `active` follows, and the patches go if drop() was
        # called meanwhile. Without the lock: an acquire between the pop and this write sets
        # `active` again after its append, and one before the read below is seen by it.
        amp_state.active = amp_state.traces > 0
        if users:
            amp_state.active = True
        if not self._kept:
            with amp_state.lock:
                if not users and not self._kept:
                    self._uninstall()

    def drop(self):
        """Remove the patches now, or when the last user releases them."""
        with amp_state.lock:
            self._kept = False
            if not amp_state.patch_users and self._ledger is not None:
                self._uninstall()

    def _uninstall(self):
        ledger, self._ledger = self._ledger, None
        ledger.restore()
        if self.float8:
            self.float8 = False
            self._forget()

    def use_float8(self):
        """Wrap the FLOAT8_FUNCS for FP8 from now on (rebuilt now if the patches are installed)."""
        with amp_state.lock:
            if not self.float8:
                self.float8 = True
                self.refresh()

    def tracing_changed(self):
        """Rebuild for amp.trace() blocks opening (every entry wrapped) or all closed (only the
        entries amp decides)."""
        with amp_state.lock:
            tracing = amp_state.traces > 0
            if tracing is not self.tracing:
                self.tracing = tracing
                self.refresh()

    def refresh(self):
        """Rebuild after a registration changed the plan; a no-op when nothing is installed."""
        with amp_state.lock:
            if self._ledger is not None:
                self._ledger.restore()
                self._ledger = None
                self._forget()
                self._install()
            else:
                self._forget()

    def _forget(self):
        self._built.clear()
        self._plan_cache = None

    def _plan(self):
        """(namespace object, name, make_replacement) for every patch to install."""
        if self._plan_cache is None:
            self._plan_cache = self._make_plan()
        return self._plan_cache

    def _make_plan(self):
        steps = [self._step(*step) for step in self.steps()]
        return steps + torch_autocast.patches() + torchscript.patches()

    def steps(self):
        """(namespace, name, kind, message, display name, aten op) of every table entry, binding
        and registration patched now: where amp decides otherwise than torch's autocast (or, while
        tracing, every entry a trace records)."""
        registered = amp_state.user_registrations
        overridden = {(id(namespace), name) for namespace, name in registered}
        float8 = set()
        if self.float8:
            float8 = {
                (id(lists.resolve_namespace(entry.namespace)), entry.name)
                for entry in lists.float8_entries()
            }
        plan = []
        for entry in lists.entries():
            namespace = lists.resolve_namespace(entry.namespace)
            if (id(namespace), entry.name) in overridden:
                continue  # a user registration decides this one
            if not hasattr(namespace, entry.name):
                logger.debug("amp: %s is not in this torch; not patched", entry.qualified_name)
                continue
            kind = entry.kind
            if kind == lists.LOWER_PRECISION and (id(namespace), entry.name) in float8:
                kind = lists.FLOAT8  # its C binding follows (_bindings)
            op = agreement.aten_op(entry.namespace, entry.name, getattr(namespace, entry.name))
            plan.append((namespace, entry.name, kind, entry.message, entry.qualified_name, op))
        paths = {id(lists.resolve_namespace(table.MODULE)): table.MODULE for table in lists.TABLES}
        for (namespace, name), kind in registered.items():
            display = f"{getattr(namespace, '__name__', type(namespace).__name__)}.{name}"
            path = paths.get(id(namespace))
            op = agreement.aten_op(path, name, getattr(namespace, name)) if path else None
            plan.append((namespace, name, kind, None, display, op))
        plan += self._bindings(plan, overridden)
        plan = self._without_delegates(plan, overridden)
        return [step for step in plan if self._patches(step)]

    def _patches(self, step):
        """Whether a plan step is patched: amp decides it on some device, or a trace records
        it (every entry but those that run as given everywhere)."""
        namespace, name, kind, message, display, op = step
        if kind == lists.FLOAT8:
            return True
        if self.tracing and kind not in lists.UNPATCHED:
            return True
        return not agreement.decides_everywhere(kind, op)

    def _step(self, namespace, name, kind, message, display, op):
        """(namespace, name, make_replacement) for a plan step."""
        if kind == lists.FLOAT8:
            return namespace, name, functools.partial(make_float8_wrapper, name=display)
        deciders = deciders_for(kind, op)
        specialised = None if self.tracing else signatures.wrapper_maker(
            namespace, name, kind, deciders
        )
        if specialised is not None:
            return namespace, name, functools.partial(specialised, name=display)
        return namespace, name, functools.partial(
            make_wrapper, kind=kind, name=display, message=message, deciders=deciders
        )

    @staticmethod
    def _bindings(plan, registered):
        """Plan steps for the C bindings (torch._C._nn) of planned functions: each with its
        function's policy, unless the user registered the binding itself."""
        planned = {(id(namespace), name): step for namespace, name, *step in plan}
        steps = []
        for (path, binding), (source_path, source) in lists.bindings().items():
            namespace = lists.resolve_namespace(path)
            step = planned.get((id(lists.resolve_namespace(source_path)), source))
            key = (id(namespace), binding)
            if step is None or key in registered or key in planned:
                continue
            if not hasattr(namespace, binding):
                logger.debug("amp: %s.%s is not in this torch; not patched", path, binding)
                continue
            kind, message = step[0], step[1]
            op = agreement.aten_op(path, binding, getattr(namespace, binding))
            steps.append((namespace, binding, kind, message, f"{path}.{binding}", op))
        return steps

    @staticmethod
    def _without_delegates(plan, registered):
        """The plan less the table functions whose delegate has the same policy: the delegate
        decides their calls, patched or (where torch's autocast decides as amp's table does)
        not (a function the user registered is always wrapped)."""
        kinds = {(id(namespace), name): kind for namespace, name, kind, *_ in plan}
        skipped = set()
        for (namespace_path, name), (target_path, target) in lists.delegates().items():
            key = (id(lists.resolve_namespace(namespace_path)), name)
            target_kind = kinds.get((id(lists.resolve_namespace(target_path)), target))
            if key not in registered and target_kind is not None and kinds.get(key) == target_kind:
                skipped.add(key)
        return [step for step in plan if (id(step[0]), step[1]) not in skipped]

    def _install(self):
        _prime_dynamo()
        ledger = PatchLedger()
        try:
            plan = self._plan()
            stale = set(map(id, ledger.reapply_all(self._built.values())))
            if stale or len(self._built) != len(plan):
                for namespace, name, make_replacement in plan:
                    key = (id(namespace), name)
                    built = self._built.get(key)
                    if built is not None and id(built) not in stale:
                        continue  # built before and back in place
                    self._built[key] = ledger.patch(namespace, name, make_replacement)
            self._hook_optimizer_steps(ledger)
        except BaseException:
            ledger.restore()
            raise
        self._ledger = ledger

    @staticmethod
    def _hook_optimizer_steps(ledger):
        """Empty the weight-cast caches after every optimizer step (torch.optim's optimizers and
        their subclasses): torch's cache cannot see the weights change."""
        handle = register_optimizer_step_post_hook(_after_optimizer_step)
        ledger.add_hook(handle, "weight-cast caches emptied after optimizer steps")


def _after_optimizer_step(optimizer, args, kwargs):
    # An optimizer amp.initialize took empties the caches itself, after its whole step.
    cache = amp_state.cast_cache
    if cache.filled and "_amp_record" not in vars(optimizer):
        cache.clear()
