"""The one process-wide state object of amp; nothing else in the package is global."""

import collections.abc
import logging
import threading

logger = logging.getLogger("amp")
logger.addHandler(logging.NullHandler())


class ThreadState(threading.local):
    """Per-thread casting state.

    The class attributes are the process-wide defaults that every thread sees until it sets its
    own value: `amp.initialize(opt_level="O1")` sets `ThreadState.policy`, so casting applies in
    every thread, while `autocast` and `disable_casts` set the attribute on the instance, which
    affects the current thread only.
    """

    policy = None  # the CastPolicy in force, or None when nothing is cast
    trace = None  # the innermost active diagnostics.Trace, or None
    autocast_depth = 0  # autocast regions entered and not yet exited in this thread


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
        # Filled by amp.casts / amp.torch_patches at import; they live here so that there is one
        # place to look for everything amp keeps between calls.
        self.cast_cache = None
        self.torch_patches = None
        self.user_registrations = Registrations()  # kept across deinitialize
        self.cuda_kernels = None  # amp.kernels.BackendChoice, probed on first use with CUDA
        self.reset()

    def reset(self):
        self.initialized = False  # amp.initialize was called and not undone
        self.enabled = False  # ... with enabled=True
        self.properties = None
        self.verbosity = 1
        self.models = []
        self.optimizers = []  # optimizer.OptimizerRecord per optimizer, in initialize's order
        self.masters = {}  # id(model parameter) -> its FP32 master (O2)
        self.shadows = {}  # id(cast model parameter) -> its shadows.Shadow (O2)
        self.cast_params = set()  # ids of the parameters the model cast made low precision
        self.loss_scalers = []
        self.ledger = None  # patching.PatchLedger of the current initialize
        self.last_overflow = None


amp_state = AmpState()
