"""Fixtures every test folder shares: the leak check, registrations, a one-rank process group,
and models initialized for a test. Constants and model makers are in tests/helpers."""

import pytest
import torch

import amp
from amp import lists
from amp.casting import torch_autocast, torchscript
from amp._state import INHERIT, amp_state
from helpers import HAS_CUDA, REQUIRE_CUDA
from helpers.models import make_model
from helpers.state import torch_autocast_state


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    for item in items:
        if "cuda" in item.keywords:
            if REQUIRE_CUDA:
                item.add_marker(
                    pytest.mark.xfail(
                        reason="AMP_REQUIRE_CUDA=1 but no GPU", strict=True, run=False
                    )
                )
            else:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session", autouse=True)
def _require_cuda_where_asked():
    if REQUIRE_CUDA and not HAS_CUDA:
        pytest.fail("AMP_REQUIRE_CUDA=1 but torch.cuda.is_available() is False")


def _patchable_attributes():
    """(namespace, name) -> the object found there, for every name amp could patch."""
    found = {}
    for entry in lists.entries():
        namespace = lists.resolve_namespace(entry.namespace)
        found[(entry.namespace, entry.name)] = vars(namespace).get(entry.name)
    for namespace, name, _ in torch_autocast.patches():  # torch's autocast surface
        found[(namespace.__name__, name)] = vars(namespace).get(name)
    for namespace, name, _ in torchscript.patches():  # TorchScript's resolvers
        found[(namespace.__name__, name)] = vars(namespace).get(name)
    return found


_TORCH_DEFAULTS = (False, False, torch.bfloat16, torch.float16, True)


@pytest.fixture(autouse=True)
def no_amp_leak():
    """Fail a test that leaves amp patches, hooks or global state behind."""
    before = _patchable_attributes()
    registrations = dict(amp_state.user_registrations)
    yield
    problems = []
    if amp_state.torch_patches.users:
        problems.append("an autocast region or O1 still holds amp's torch patches")
    # Regions leave the patches installed until amp.deinitialize(); it must restore every
    # attribute by identity.
    if not amp_state.initialized:
        amp_state.torch_patches.drop()
    leaked = [
        f"{namespace}.{name}"
        for (namespace, name), value in _patchable_attributes().items()
        if value is not before[(namespace, name)]
    ]
    if leaked:
        problems.append(f"test leaked amp patches: {', '.join(leaked[:10])}")
    if amp_state.initialized:
        problems.append("amp is still initialized")
    if amp_state.default_policy is not None or amp_state.thread.policy is not INHERIT:
        problems.append("a casting policy is still in force")
    if amp_state.torch_patches.installed:
        problems.append("torch patches are still installed")
    if amp_state.user_registrations != registrations:
        problems.append("registrations changed (use the `registrations` fixture)")
        amp_state.user_registrations.clear()
        amp_state.user_registrations.update(registrations)
    if amp_state.thread.trace is not None:
        problems.append("a trace is still active")
    native = torch_autocast_state()
    if native != _TORCH_DEFAULTS:
        problems.append(f"torch's autocast state is {native}, not its defaults")
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        torch.set_autocast_dtype("cuda", torch.float16)
        torch.set_autocast_cache_enabled(True)
    if problems:
        amp.deinitialize()
        pytest.fail("; ".join(problems))


@pytest.fixture
def registrations():
    """Lets a test register functions; forgets its registrations afterwards."""
    saved = dict(amp_state.user_registrations)
    yield
    amp_state.user_registrations.clear()
    amp_state.user_registrations.update(saved)
    amp_state.torch_patches.refresh()


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A default process group of one rank (what ZeroRedundancyOptimizer and DDP need to exist)."""
    store = tmp_path_factory.mktemp("store") / "store"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture
def trained():
    """trained(opt_level, momentum=0.9, **initialize_kwargs) -> (model, optimizer): the default
    helpers.models.make_model() with SGD(lr=0.1), initialized; amp.deinitialize() afterwards."""

    def make(opt_level, momentum=0.9, **kwargs):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        kwargs.setdefault("verbosity", 0)
        return amp.initialize(model, optimizer, opt_level=opt_level, **kwargs)

    yield make
    amp.deinitialize()


@pytest.fixture
def forget_overflows():
    """Ends an origin watch a test leaves armed (a GradScaler's outlives its loop) and forgets the
    last overflow report."""
    yield
    amp_state.origin_watch.disarm()
    amp_state.last_overflow = None


@pytest.fixture
def deinitialized():
    """amp.deinitialize() after the test, for a test that ends with amp initialized."""
    yield
    amp.deinitialize()


@pytest.fixture
def one_thread():
    """torch on one thread: its CPU kernels split each thread's range into a vector loop and a
    scalar loop that rounds differently, so bit-for-bit comparisons fix the split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def emulated_cupy(monkeypatch):
    """amp.kernels runs CPU tensors through the CuPy backend on multi_tensor.cu compiled for the
    CPU, as it runs CUDA tensors on a GPU; returns the recorded launches."""
    from helpers import fake_cupy
    from helpers.cuda_emulation import build

    if build.compiler() is None:
        pytest.skip("needs g++ for the emulated grid")
    backend, launches = fake_cupy.install(monkeypatch, kernels="compiled")
    monkeypatch.setattr(amp.kernels, "_torch_backend", backend)
    monkeypatch.setattr(amp.kernels, "fuses", lambda device: True)
    return launches
