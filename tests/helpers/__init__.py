"""What the tests share that is not a test: constants, amp's casting as a context, the model and
loss makers (helpers.models), and the scripts the tests run in other processes (ranks, resume,
apex_scripts)."""

import contextlib
import os
import pathlib

import pytest
import torch

import amp

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

HAS_CUDA = torch.cuda.is_available()
REQUIRE_CUDA = os.environ.get("AMP_REQUIRE_CUDA", "") not in ("", "0")

OPT_LEVELS = ["O0", "O1", "O2", "O3"]
DTYPES = [torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def subprocess_env(**extra):
    """The environment for a Python process the tests start: this checkout's amp first, and
    tests/ so that the process can import `helpers`."""
    path = os.pathsep.join(filter(None, [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


@contextlib.contextmanager
def casting(mode, dtype, model=None):
    """amp's casting in force for the block: an O1 initialize, or an amp.autocast region."""
    if mode == "O1":
        amp.initialize(model or torch.nn.Linear(1, 1), opt_level="O1", dtype=dtype, verbosity=0)
        try:
            yield
        finally:
            amp.deinitialize()
    else:
        with amp.autocast(dtype=dtype):
            yield
