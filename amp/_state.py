"""The one process-wide state object of amp; nothing else in the package is global."""

import collections.abc
import logging
import threading

logger = logging.getLogger("amp")
logger.addHandler(logging.NullHandler())


class _Inherit:
    def __repr__(self):
        return "INHERIT"


INHERIT = _Inherit()  # a thread's policy when it has set none: ThreadState.default_policy holds


class ThreadState(threading.local):
    """Per-thread casting state.

    `amp.initialize(opt_level="O1")` sets the class attribute `default_policy`, so casting applies
    in every thread; `autocast` and `disable_casts` set `policy` on the instance, which affects the
    current thread only. Every thread's instance holds all three attributes from its first use:
    torch.compile guards a value read through a threading.local's class default with a check of
    the instance dict that misses later per-thread writes (a graph made outside a region would be
    reused inside one).
    """

    default_policy = None  # the CastPolicy of every thread whose own policy is INHERIT
    first_policy = staticmethod(lambda: INHERIT)  # a new thread's policy (casting/torch_autocast)

    def __init__(self):
        self.policy = ThreadState.first_policy()  # this thread's own: a CastPolicy, None or INHERIT
        self.trace = None  # the innermost active casting.trace.Trace, or None
        self.autocast_depth = 0  # autocast regions entered and not yet exited in this thread
        self.fp32_scopes = []  # casting-off scopes of the fp32_modules running in this thread

    def current_policy(self):
        """The CastPolicy in force in this thread, or None."""
        policy = self.policy
        return ThreadState.default_policy if policy is INHERIT else policy


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


class AmpState:
    def __init__(self):
        self.thread = ThreadState()
        self.lock = threading.RLock()
        # Filled by casting.casts / casting.torch_patches at import; they live here so that there
        # is one place to look for everything amp keeps between calls.
        self.cast_cache = None
        self.torch_patches = None
        self.user_registrations = Registrations()  # kept across deinitialize
        self.cuda_kernels = None  # amp.kernels.BackendChoice, probed on first use with CUDA
        # Some thread casts (a region, O1) or traces: only then does a patched call look at its
        # thread's state (a threading.local read costs about 150 ns; this flag, one attribute).
        self.active = False
        self.traces = 0  # amp.trace() blocks open in any thread
        # scaling.origin.OriginWatch, set at its import; it outlives initialize (GradScaler uses it)
        self.origin_watch = None
        self.reset()

    def refresh_active(self):
        """Recompute `active` (under `lock`) after a region, an O1 or a trace began or ended."""
        self.active = self.torch_patches.users > 0 or self.traces > 0

    def reset(self):
        self.initialized = False  # amp.initialize was called and not undone
        self.enabled = False  # ... with enabled=True
        self.properties = None
        self.verbosity = 1
        self.models = []
        self.optimizers = []  # weights.optimizer.OptimizerRecord per optimizer, in initialize's order
        self.masters = {}  # id(model parameter) -> its FP32 master (O2)
        self.shadows = {}  # id(cast model parameter) -> its weights.shadows.Shadow (O2)
        self.fp32_modules = set()  # the modules fp32_modules= keeps in FP32 (casting.fp32_modules)
        self.cast_params = set()  # ids of the parameters the model cast made low precision
        self.loss_scalers = []
        self.ledger = None  # casting.patching.PatchLedger of the current initialize
        self.last_overflow = None
        # A run of steps skipped for a non-finite loss: None, "pending" (to warn) or "warned"
        self.nonfinite_loss_run = None
        if self.origin_watch is not None:
            self.origin_watch.disarm()  # no hook outlives the initialize that armed it
        self.parameter_watch = None  # compat.distributed.ParameterWatch of the optimizers' parameters


amp_state = AmpState()
