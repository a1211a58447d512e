"""The package surface: public names, python -m amp, no CuPy or CUDA at import."""

import subprocess
import sys

import amp

API = {  # ../shared/API.md
    "initialize",
    "deinitialize",
    "scale_loss",
    "disable_casts",
    "master_params",
    "state_dict",
    "load_state_dict",
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "autocast",
    "custom_fwd",
    "custom_bwd",
    "GradScaler",
    "trace",
    "last_overflow",
    "NonFiniteLossWarning",
    "audit",
}


def test_all_is_the_api_and_importable():
    assert set(amp.__all__) == API
    assert all(hasattr(amp, name) for name in amp.__all__)
    assert isinstance(amp.__version__, str)


def test_environment_report():
    result = subprocess.run([sys.executable, "-m", "amp"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"amp {amp.__version__}"
    assert any(line.startswith("torch ") for line in lines)
    assert any(line.startswith("wrapt ") for line in lines)
    assert any(line.startswith("cupy ") for line in lines)
    backend = [line for line in lines if line.startswith("kernel backend on CUDA tensors:")]
    assert backend and "(" in backend[0]  # which backend, and why
    assert any("op tables:" in line for line in lines)
    low_precision = [line for line in lines if line.startswith("low precision on cpu (")]
    assert low_precision and "float16" in low_precision[0]  # what the CPU does with it
    apex = [line for line in lines if line.startswith("apex compatibility package: ")]
    assert len(apex) == 1 and ("installed (" in apex[0] or "not installed" in apex[0])


def test_import_touches_neither_cupy_nor_cuda():
    code = (
        "import sys, torch\n"
        "torch.cuda.init = lambda: (_ for _ in ()).throw(AssertionError('CUDA touched'))\n"
        "import amp\n"
        "assert 'cupy' not in sys.modules\n"
        "print('clean')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "clean", result.stderr
