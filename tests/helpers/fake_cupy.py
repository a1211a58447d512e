"""A stand-in for CuPy that runs amp's CuPy backend on CPU tensors, for tests without a GPU.

Two kinds of kernels behind it:
- "python": the kernels read the by-value Meta struct the backend packs and do, through the raw
  data pointers, what multi_tensor.cu means to do, in torch. Quick; checks the backend's host
  code (grouping, packing, launch arguments, pointer arithmetic, launch splitting).
- "compiled": RawModule compiles the source the backend hands it with g++ against the CUDA shim
  (tests/helpers/cuda_emulation), with -ftz=true appended as CuPy does, and launches run the CUDA code
  itself on an emulated grid, threads in the order asked for.

`install_float8` runs amp/kernels/float8.py's CuPy path (float8*.cu, compiled) on CPU tensors.
"""

import contextlib
import ctypes
import importlib
import sys
import types

import torch

from amp.kernels import _layout, _sources
from helpers.cuda_emulation import build

_DTYPES = {"float": torch.float32, "__half": torch.float16, "__nv_bfloat16": torch.bfloat16}
TYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}  # torch dtype -> CUDA type name


def _view(address, numel, dtype):
    """A tensor over `numel` elements of `dtype` at a raw host address (shares the memory)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    size = numel * torch.empty((), dtype=dtype).element_size()
    buffer = (ctypes.c_char * size).from_address(address)
    return torch.frombuffer(buffer, dtype=dtype, count=numel)


def _scalar(address):
    return _view(address, 1, torch.float32)[0].item()


class Launches:
    """What the fake recorded: one entry per kernel launch, and the name expressions of each
    RawModule the backend made (what a GPU would compile)."""

    def __init__(self):
        self.calls = []
        self.modules = []


_PYTHON_KERNELS = {
    "amp_unscale",
    "amp_scale_copy",
    "amp_scale_add",
    "amp_sum_squares",
    "amp_norm_finalize",
}


class FakeKernel:
    def __init__(self, name, launches):
        self.name = name
        kernel, _, types_part = name.partition("<")
        self.kernel = kernel
        # None for a template argument that is no element type (the compact steps' amp::Compact)
        self.types = [_DTYPES.get(t.strip()) for t in types_part[:-1].split(",") if t.strip()]
        self.launches = launches

    def compile(self):
        pass

    def __call__(self, grid, block, args, stream=None):
        assert block == (_layout.BLOCK,) and len(grid) == 1 and grid[0] >= 1
        assert stream is not None and hasattr(stream, "ptr")
        if self.kernel not in _PYTHON_KERNELS:
            raise NotImplementedError(f"{self.name}: install with kernels='compiled' to run it")
        self.launches.calls.append((self.name, grid, len(args)))
        if self.kernel == "amp_norm_finalize":
            partial, count, out = args
            _view(out, 1, torch.float32)[0] = _view(partial, count, torch.float64).sum().sqrt()
            return
        meta, chunk = args[0], args[-1]
        record = meta[0]
        launch = _layout.Launch(meta, int(record["chunk_start"][int(record["ntensors"])]), 0)
        assert grid[0] <= max(launch.chunks, 1)
        for chunk_index, (slot, first, count) in enumerate(_layout.simulate(launch, chunk)):
            self._chunk(record, args, chunk_index, slot, first, count)

    def _chunk(self, record, args, chunk_index, slot, first, count):
        source_dtype = self.types[0]
        source = _view(
            int(record["ptr"][0][slot]) + first * source_dtype.itemsize, count, source_dtype
        )
        if self.kernel == "amp_sum_squares":
            partial, first_chunk = args[1], args[2]
            _view(partial, first_chunk + chunk_index + 1, torch.float64)[
                first_chunk + chunk_index
            ] = source.double().square().sum()
            return
        scale_address, flag_address = args[1], args[2]
        values = source.float()
        if flag_address and not torch.isfinite(values).all():
            _view(flag_address, 1, torch.float32)[0] = 1.0
        if scale_address:
            values = values * _scalar(scale_address)
        if self.kernel == "amp_unscale":
            source.copy_(values.to(source_dtype))
            return
        destination_dtype = self.types[1]
        destination = _view(
            int(record["ptr"][1][slot]) + first * destination_dtype.itemsize,
            count,
            destination_dtype,
        )
        if self.kernel == "amp_scale_add":
            values = destination.float() + values
        destination.copy_(values.to(destination_dtype))


class CompiledKernel:
    """One kernel of a source compiled for the CPU; calls run the CUDA code on an emulated grid."""

    def __init__(self, module, name, launches, order, seed):
        self.module, self.name, self.launches = module, name, launches
        self.order, self.seed = order, seed

    def compile(self):
        pass

    def __call__(self, grid, block, args, stream=None):
        assert stream is not None and hasattr(stream, "ptr")
        self.launches.calls.append((self.name, grid, len(args)))
        self.module.launch(self.name, grid, block, args, order=self.order, seed=self.seed)


_compiled = {}  # (code, options, names) -> build.Module: one build per test session


def compiled_module(code, options, names, cuda_headers=True):
    """The source compiled as CuPy would (-ftz=true last), once per process; a family's source
    with all its names (one g++ build serves each of its per-kernel modules)."""
    for family in _sources.FAMILIES.values():
        if set(names) <= set(family.names) and code == _sources.source_of(family):
            names = family.names
            break
    key = (code, tuple(options), tuple(names), cuda_headers)
    if key not in _compiled:
        _compiled[key] = build.compile_module(
            code, tuple(options) + ("-ftz=true",), names, use_cuda_headers=cuda_headers
        )
    return _compiled[key]


def install(
    monkeypatch,
    multiprocessors=2,
    kernels="python",
    order="forward",
    seed=0,
    cuda_headers=True,
    torch_cuda_adam=False,
):
    """Put the fake CuPy in sys.modules and return (the backend module on it, Launches).

    kernels="compiled" runs the CUDA source itself (needs g++), each family the backend compiles,
    threads in `order` ("forward", "reversed", "shuffled" with `seed`) within every phase between
    barriers; cuda_headers=False takes __half / __nv_bfloat16 from the shim's fallback headers
    even where CUDA's are installed. The CuPy build steps AdamW / Adam with torch's CUDA formula
    (_sources.GPU_OPTIONS); on CPU tensors the oracle, the torch backend, runs torch's CPU fused
    ops, so the compiled kernels take the CPU formula unless torch_cuda_adam.
    """
    launches = Launches()

    class RawModule:
        def __init__(self, code, options, name_expressions):
            assert "-std=c++17" in options
            if any(name.startswith("amp_unscale<") for name in name_expressions):
                assert any(o.startswith("-DAMP_MAX_TENSORS_D2=") for o in options)
            self.names = set(name_expressions)
            launches.modules.append(tuple(name_expressions))
            if not torch_cuda_adam:
                options = tuple(o for o in options if o != "-DAMP_TORCH_CUDA_ADAM")
            if kernels == "compiled":
                self.compiled = compiled_module(code, options, list(name_expressions), cuda_headers)

        def get_function(self, name):
            assert name in self.names, name
            if kernels == "compiled":
                return CompiledKernel(self.compiled, name, launches, order, seed)
            return FakeKernel(name, launches)

    cupy = types.ModuleType("cupy")
    cupy.__version__ = "fake"
    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(
        is_available=lambda: True,
        Device=lambda index=None: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(driverGetVersion=lambda: 12090),
    )
    nvrtc = types.ModuleType("cupy_backends.cuda.libs.nvrtc")
    nvrtc.getVersion = lambda: (12, 9)
    for name, module in {
        "cupy": cupy,
        "cupy_backends": types.ModuleType("cupy_backends"),
        "cupy_backends.cuda": types.ModuleType("cupy_backends.cuda"),
        "cupy_backends.cuda.libs": types.ModuleType("cupy_backends.cuda.libs"),
        "cupy_backends.cuda.libs.nvrtc": nvrtc,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    for module in ("_cupy_backend", "_cupy_compact", "_cupy_device", "_cupy_float8"):
        monkeypatch.delitem(sys.modules, f"amp.kernels.{module}", raising=False)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: types.SimpleNamespace(
            multi_processor_count=multiprocessors, major=9, minor=0
        ),
    )
    import amp.kernels

    # `from . import _cupy_device` takes the package's attribute if an earlier import left one.
    monkeypatch.delattr(amp.kernels, "_cupy_device", raising=False)
    backend = importlib.import_module("amp.kernels._cupy_backend")
    monkeypatch.setattr(amp.kernels, "_cupy_backend", backend, raising=False)
    monkeypatch.setattr(backend.cuda, "stream", lambda index: types.SimpleNamespace(ptr=0))
    # Registered with monkeypatch so that teardown removes them: the real ones are imported afresh.
    monkeypatch.setitem(sys.modules, "amp.kernels._cupy_backend", backend)
    monkeypatch.setitem(sys.modules, "amp.kernels._cupy_device", backend.cuda)
    monkeypatch.setitem(
        sys.modules, "amp.kernels._cupy_compact", sys.modules["amp.kernels._cupy_compact"]
    )
    monkeypatch.setattr(amp.kernels, "_cupy_device", backend.cuda, raising=False)
    return backend, launches


def install_float8(monkeypatch, order="forward", seed=0):
    """amp/kernels/float8.py's CuPy path on CPU tensors: float8*.cu compiled (needs g++), run on the
    emulated grid (threads in `order`). Returns (its host module, Launches)."""
    _, launches = install(monkeypatch, kernels="compiled", order=order, seed=seed)
    import amp.kernels
    from amp.kernels import float8

    monkeypatch.delattr(amp.kernels, "_cupy_float8", raising=False)
    module = importlib.import_module("amp.kernels._cupy_float8")
    monkeypatch.setitem(sys.modules, "amp.kernels._cupy_float8", module)  # teardown drops it
    monkeypatch.setattr(amp.kernels, "_cupy_float8", module, raising=False)
    monkeypatch.setattr(float8, "_cupy_for", lambda tensor: module)
    return module, launches
