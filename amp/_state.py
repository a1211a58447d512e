"""The one process-wide state object of amp; nothing else in the package is global."""

import collections.abc
import logging
import threading

__all__ = ["logger", "INHERIT", "ThreadState", "Registrations", "AmpState", "amp_state"]

logger = logging.getLogger("amp")
logger.addHandler(logging.NullHandler())


class _Inherit:
    def __repr__(self):
        return "INHERIT"


INHERIT = _Inherit()  # a thread's policy when it has set none: AmpState.default_policy holds


class ThreadState(threading.local):
    """Per-thread casting state.

    `autocast` and `disable_casts` set `policy`, which affects the current thread only. A thread
    whose policy is INHERIT follows `AmpState.default_policy`, except where O1 set it: O1 casts
    through torch's autocast state, which is per thread, so only in the thread that called
    `initialize` (`AmpState.o1_thread`), as a torch.autocast region would. Writing `policy` (amp's
    optimizer step turns casting off so) also sets torch's autocast state of the thread
    (AmpState.policy_written); regions write `own_policy`, where it is kept, and set torch's state
    themselves. Every thread's instance holds all its attributes from its first use:
    torch.compile guards a value read through a threading.local's class default with a check of
    the instance dict that misses later per-thread writes (a graph made outside a region would be
    reused inside one).
    """

    def __init__(self, state):
        self._state = state
        self.ident = threading.get_ident()
        self.own_policy = INHERIT  # this thread's own: a CastPolicy, None or INHERIT
        self.trace = None  # the innermost active diagnostics.trace.Trace, or None
        self.fp32_scopes = []  # casting-off scopes of the fp32_modules running in this thread
        self.saved_native = []  # torch's autocast state saved by direct writes of `policy`
        self.depth = 0  # amp regions and scopes open in this thread
        self.unwound = None  # called once depth returns to 0 (O1 ended inside a region)

    @property
    def policy(self):
        policy = self.own_policy
        if policy is INHERIT and self._state.o1_thread not in (None, self.ident):
            return None  # O1's policy is its own thread's
        return policy

    @policy.setter
    def policy(self, value):
        old, self.own_policy = self.own_policy, value
        self._state.policy_written(self, old, value)


class Registrations(collections.abc.MutableMapping):
    """(namespace, name) -> policy kind, with namespaces compared by identity.

    A namespace may be any object with the attribute (a `types.SimpleNamespace`, an instance
    whose class defines `__eq__`), hashable or not: keys are never hashed as they are.
    """

    def __init__(self):
        self._entries = {}  # (id(namespace), name) -> (namespace, name, kind)

    def __getitem__(self, key):
        namespace, name = key
        entry = self._entries.get((id(namespace), name))
        if entry is None or entry[0] is not namespace:
            raise KeyError(key)
        return entry[2]

    def __setitem__(self, key, kind):
        namespace, name = key
        self._entries[(id(namespace), name)] = (namespace, name, kind)

    def __delitem__(self, key):
        self[key]  # KeyError if absent
        namespace, name = key
        del self._entries[(id(namespace), name)]

    def __iter__(self):
        return ((namespace, name) for namespace, name, _ in list(self._entries.values()))

    def __len__(self):
        return len(self._entries)


def _unaware(thread, old, new):
    return None


class AmpState:
    """Everything amp keeps between calls. The objects of the layers above (the weight-cast cache,
    the patch set, the origin watch, the first policy of a new thread) are given to `build` by
    the package's __init__, the one place global state is made."""

    def __init__(self):
        # Called on a direct write of a thread's policy (casting.native_autocast.policy_written)
        self.policy_written = _unaware
        self.thread = ThreadState(self)
        self.lock = threading.RLock()
        self.default_policy = None  # the CastPolicy of the threads whose own policy is INHERIT
        self.o1_thread = None  # the thread O1 casts in (threading.get_ident()); None: every thread
        self.cast_cache = None  # casting.casts.WeightCastCache
        self.torch_patches = None  # casting.torch_patches.TorchPatches
        # One item per open region and O1 initialization holding the torch patches: appended and
        # popped without the lock (each is atomic), so a region needs the lock only to install
        # the patches or to leave them with no user.
        self.patch_users = []
        self.user_registrations = Registrations()  # kept across deinitialize
        self.cuda_kernels = None  # amp.kernels.BackendChoice, probed on first use with CUDA
        # Some thread casts (a region, O1) or traces: only then does a patched call look at its
        # thread's state (a threading.local read costs about 150 ns; this flag, one attribute).
        self.active = False
        self.traces = 0  # amp.trace() blocks open in any thread
        # diagnostics.origin.OriginWatch; it outlives initialize (GradScaler uses it)
        self.origin_watch = None
        self.reset()

    def build(self, cast_cache, torch_patches, origin_watch, policy_written):
        """Give the state its objects from the layers above (once, from amp/__init__.py)."""
        self.cast_cache = cast_cache
        self.torch_patches = torch_patches
        self.origin_watch = origin_watch
        self.policy_written = policy_written

    def current_policy(self):
        """The CastPolicy in force in this thread, or None."""
        policy = self.thread.policy
        return self.default_policy if policy is INHERIT else policy

    def refresh_active(self):
        """Recompute `active` (under `lock`) after a region, an O1 or a trace began or ended."""
        self.active = bool(self.patch_users) or self.traces > 0

    def reset(self):
        self.initialized = False  # amp.initialize was called and not undone
        self.enabled = False  # ... with enabled=True
        self.properties = None
        self.verbosity = 1
        self.models = []
        self.optimizers = []  # weights.optimizer.OptimizerRecord per optimizer, in initialize's order
        # O2: id(cast parameter) -> the weights.rows.Rows holding the rest of its FP32 value (its
        # optimizer's owner, or this initialize's frozen rows), and those Rows
        self.owners = {}
        self.rows = []
        self.fp32_modules = set()  # the modules fp32_modules= keeps in FP32 (casting.fp32_modules)
        self.cast_params = set()  # ids of the parameters the model cast made low precision
        self.loss_scalers = []
        self.ledger = None  # patching.PatchLedger of the current initialize
        self.last_overflow = None
        # A run of steps skipped for a non-finite loss: None, "pending" (to warn) or "warned"
        self.nonfinite_loss_run = None
        if self.origin_watch is not None:
            self.origin_watch.disarm()  # no hook outlives the initialize that armed it


amp_state = AmpState()
