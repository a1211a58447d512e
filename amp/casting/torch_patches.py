"""The patch set: torch functions and Tensor methods wrapped from amp/lists and registrations, and
torch's autocast surface (torch_autocast.py).

O1 and autocast regions share it. It is installed when amp first casts (an O1 `initialize`, or
the first region) and stays installed, so a region costs a state change rather than hundreds of
`setattr`s; outside amp's casting every wrapper calls its original at once. `amp.deinitialize()`
removes it (when the last open region exits, if one is open), after which every torch attribute
is the original object again. Replacement functions are built once and reused.
"""

import functools
import logging

from .. import lists
from .._state import amp_state
from . import torch_autocast, torchscript
from ..patching import PatchLedger
from .float8_wrapper import make_float8_wrapper
from .wrappers import make_wrapper

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

    @property
    def installed(self):
        return self._ledger is not None

    @property
    def users(self):
        """Open regions and O1 initializations holding the patches now."""
        return amp_state.patch_users

    def acquire(self):
        with amp_state.lock:
            if self._ledger is None:
                self._install()
            amp_state.patch_users += 1
            self._kept = True
            amp_state.active = True

    def release(self):
        with amp_state.lock:
            if amp_state.patch_users <= 0:
                raise RuntimeError("amp's torch patches were released more often than acquired")
            amp_state.patch_users -= 1
            amp_state.refresh_active()
            if amp_state.patch_users == 0 and not self._kept:
                self._uninstall()

    def drop(self):
        """Remove the patches now, or when the last user releases them."""
        with amp_state.lock:
            self._kept = False
            if amp_state.patch_users == 0 and self._ledger is not None:
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
            if (id(namespace), entry.name) in overridden or entry.kind in lists.UNPATCHED:
                continue  # a user registration decides this one, or torch's own rule does
            if not hasattr(namespace, entry.name):
                logger.debug("amp: %s is not in this torch; not patched", entry.qualified_name)
                continue
            kind = entry.kind
            if kind == lists.LOWER_PRECISION and (id(namespace), entry.name) in float8:
                kind = lists.FLOAT8  # its C binding follows (_bindings)
            plan.append((namespace, entry.name, kind, entry.message, entry.qualified_name))
        for (namespace, name), kind in registered.items():
            display = f"{getattr(namespace, '__name__', type(namespace).__name__)}.{name}"
            plan.append((namespace, name, kind, None, display))
        plan += self._bindings(plan, overridden)
        wrapped = [
            (
                namespace,
                name,
                functools.partial(make_float8_wrapper, name=display)
                if kind == lists.FLOAT8
                else functools.partial(make_wrapper, kind=kind, name=display, message=message),
            )
            for namespace, name, kind, message, display in self._without_delegates(plan, overridden)
        ]
        return wrapped + torch_autocast.patches() + torchscript.patches()

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
            kind, message, _ = step
            steps.append((namespace, binding, kind, message, f"{path}.{binding}"))
        return steps

    @staticmethod
    def _without_delegates(plan, registered):
        """The plan less the table functions whose delegate is patched with the same policy
        (a function the user registered is always wrapped)."""
        kinds = {(id(namespace), name): kind for namespace, name, kind, _, _ in plan}
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
            if not stale and len(self._built) == len(plan):
                self._ledger = ledger  # every replacement was built before and is back in place
                return
            for namespace, name, make_replacement in plan:
                key = (id(namespace), name)
                built = self._built.get(key)
                if built is not None and id(built) not in stale:
                    continue
                self._built[key] = ledger.patch(namespace, name, make_replacement)
        except BaseException:
            ledger.restore()
            raise
        self._ledger = ledger
