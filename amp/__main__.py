"""`python -m amp`: versions, devices, what they do with float16/bfloat16, and which kernel backend
runs on CUDA tensors (and why)."""

import importlib
import platform
import sys

__all__ = ["report"]


def _version(module_name):
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # not installed, or fails to import: say which
        return f"not available ({type(error).__name__}: {error})"
    return getattr(module, "__version__", "unknown version")


def report():
    import torch

    import amp
    from amp import hardware, kernels, lists
    from amp.apex_interop import real_apex

    lines = [
        f"amp {amp.__version__}",
        f"python {platform.python_version()} ({sys.executable})",
        f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"wrapt {_version('wrapt')}",
        f"cupy {_version('cupy')}",
        f"numpy {_version('numpy')}",
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            lines.append(
                f"device cuda:{index}: {properties.name}, compute capability "
                f"{properties.major}.{properties.minor}, {properties.total_memory / 2**30:.1f} GiB"
            )
    else:
        lines.append("devices: cpu only (torch.cuda.is_available() is False)")
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    lines.extend(f"low precision on {hardware.support(d).summary()}" for d in devices)
    choice = kernels.cuda_backend()
    lines.append(f"kernel backend on CUDA tensors: {choice.name} ({choice.reason})")
    lines.append("kernel backend on CPU tensors: torch")
    compact = "its kernels" if choice.name == "cupy" else "the torch backend, in pieces"
    lines.append(
        "O2 compact state (master_weights='compact', optimizer_state='bf16'/'int8'): "
        f"bf16 models, torch.optim.AdamW/Adam/SGD; on CUDA tensors by {compact}"
    )
    missing = lists.missing()
    lines.append(
        f"op tables: {sum(1 for _ in lists.entries())} entries, "
        f"{len(missing)} not in this torch"
        + (f" ({', '.join(entry.qualified_name for entry in missing)})" if missing else "")
    )
    lines.append(real_apex.describe())
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
