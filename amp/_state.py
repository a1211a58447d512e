"""The one process-wide state object of amp; nothing else in the package is global."""

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


class AmpState:
    def __init__(self):
        self.thread = ThreadState()
        self.lock = threading.RLock()
        # Filled by amp.casts / amp.torch_patches at import; they live here so that there is one
        # place to look for everything amp keeps between calls.
        self.cast_cache = None
        self.torch_patches = None
        self.user_registrations = {}  # (module, name) -> policy kind, kept across deinitialize
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
        self.master_versions = {}  # id(model parameter) -> its version when amp last wrote it
        self.cast_params = set()  # ids of the parameters the model cast made low precision
        self.loss_scalers = []
        self.ledger = None  # patching.PatchLedger of the current initialize
        self.last_overflow = None
        self.parameter_watch = None  # distributed.ParameterWatch of the optimizers' parameters


amp_state = AmpState()
