"""Compile CUDA source for the CPU with g++ and the shim in this folder; launch its kernels.

`compile_module(code, options, names)` takes what CuPy's RawModule takes and returns a Module
whose `launch(name, grid, block, args, order=..., seed=...)` marshals arguments as CuPy does
(cupy/cuda/function.pyx) and runs the grid (cuda_emulation.h). Builds are cached on disk under
the temporary directory, keyed by everything that goes into them, so a test session compiles
each variant once and later sessions not at all.
"""

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).parent
HEADER = HERE / "cuda_emulation.h"
FALLBACK = HERE / "fallback"
ORDERS = {"forward": 0, "reversed": 1, "shuffled": 2}
CACHE = pathlib.Path(tempfile.gettempdir()) / "amp-cuda-emulation"
HAS_FTZ = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")  # MXCSR FTZ/DAZ


def compiler():
    """The g++ to build with, or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def cuda_include():
    """CUDA's include folder if it has cuda_fp16.h (its host code is used), else None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(pathlib.Path(nvcc).resolve().parent.parent))
    for root in filter(None, candidates):
        include = pathlib.Path(root) / "include"
        if (include / "cuda_fp16.h").is_file() and (include / "cuda_bf16.h").is_file():
            return include
    return None


def _translate(options):
    """NVRTC options -> (g++ options, ftz). Unknown options are an error, not ignored."""
    flags, ftz = [], False
    for option in options:
        if option.startswith("-D") or option.startswith("-std="):
            flags.append(option)
        elif option in ("-ftz=true", "-ftz=false"):
            ftz = option == "-ftz=true"  # the last one wins, as in NVRTC
        else:
            raise ValueError(f"the CUDA emulation does not know the NVRTC option {option!r}")
    return flags, ftz


class KernelError(RuntimeError):
    """A launch the emulation refused or a grid whose threads did not meet at a barrier."""


class Module:
    """The kernels of one compiled source, callable by name expression."""

    def __init__(self, path, names, ftz):
        self._library = ctypes.CDLL(str(path))
        self.ftz = ftz
        self._functions = {}
        for index, name in enumerate(names):
            function = getattr(self._library, f"amp_emu_kernel_{index}")
            function.restype = ctypes.c_int
            self._functions[name] = function

    def launch(self, name, grid, block, args, *, order="forward", seed=0):
        (grid_x,) = grid
        (block_x,) = block
        buffers = [_marshal(arg) for arg in args]
        pointers = (ctypes.c_void_p * max(len(buffers), 1))(
            *[ctypes.cast(buffer, ctypes.c_void_p) for buffer in buffers]
        )
        sizes = (ctypes.c_longlong * max(len(buffers), 1))(*[len(b) for b in buffers])
        spec = _LaunchSpec(grid_x, block_x, ORDERS[order], seed, int(self.ftz))
        error = ctypes.create_string_buffer(512)
        status = self._functions[name](
            ctypes.byref(spec), pointers, sizes, len(buffers), error, len(error)
        )
        if status:
            raise KernelError(f"{name}: {error.value.decode()}")


class _LaunchSpec(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint),
        ("block", ctypes.c_uint),
        ("order", ctypes.c_int),
        ("seed", ctypes.c_ulonglong),
        ("ftz", ctypes.c_int),
    ]


def _marshal(arg):
    """The bytes CuPy hands the driver for one kernel argument (its table in function.pyx)."""
    if isinstance(arg, np.ndarray):
        if arg.size != 1:
            raise TypeError("Only numpy.ndarrays of size one can be passed by value")
        data = arg.tobytes()
    elif isinstance(arg, np.generic):
        data = arg.tobytes()
    elif arg is None:
        data = np.uint64(0).tobytes()
    elif isinstance(arg, bool):
        data = np.bool_(arg).tobytes()
    elif isinstance(arg, int):
        data = (np.uint64(arg) if arg >= 2**63 else np.int64(arg)).tobytes()
    elif isinstance(arg, float):
        data = np.float64(arg).tobytes()
    else:
        raise TypeError(f"Unsupported type {type(arg)}")
    return ctypes.create_string_buffer(data, len(data))


def _launcher_source(names):
    lines = []
    for index, name in enumerate(names):
        lines.append(
            f'extern "C" int amp_emu_kernel_{index}(const amp_emu::LaunchSpec* spec, '
            "void* const* args, const long long* sizes, int count, char* error, size_t bytes) {\n"
            f"  return amp_emu::launch(&{name}, *spec, args, sizes, count, error, bytes);\n}}\n"
        )
    return "".join(lines)


def build(code, flags, names, *, extra_source="", use_cuda_headers=True):
    """Compile `code` plus launchers for `names` into a shared library; return its path."""
    gxx = compiler()
    if gxx is None:
        raise RuntimeError("g++ is not installed")
    include = cuda_include() if use_cuda_headers else None
    include_flags = ["-I", str(include)] if include else ["-I", str(FALLBACK)]
    source = code + "\n" + _launcher_source(names) + extra_source
    command = [gxx, "-O2", "-shared", "-fPIC", "-w", "-include", str(HEADER), *include_flags]
    command += flags
    key = hashlib.sha256()
    for part in [source, " ".join(command), HEADER.read_text()] + [
        p.read_text() for p in sorted(FALLBACK.iterdir())
    ]:
        key.update(part.encode())
    folder = CACHE / key.hexdigest()[:24]
    library = folder / "kernels.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernels.cpp").write_text(source)
    partial = folder / f"kernels.{os.getpid()}.so"
    result = subprocess.run(
        command + ["-x", "c++", str(folder / "kernels.cpp"), "-o", str(partial)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"g++ failed on the emulated CUDA source:\n{result.stderr[-4000:]}")
    os.replace(partial, library)
    return library


def compile_module(code, options, names, *, use_cuda_headers=True):
    """What cupy.RawModule(code=, options=, name_expressions=) compiles, for the CPU."""
    flags, ftz = _translate(options)
    library = build(code, flags, names, use_cuda_headers=use_cuda_headers)
    return Module(library, names, ftz)
