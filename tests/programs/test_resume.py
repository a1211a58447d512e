"""Bit-exact resume: a run saved at a step and resumed from that checkpoint (in the same process
or in a fresh one) ends exactly where the run that never stopped ends.

The scripts (tests/helpers/resume.py): amp's own API with batch norm, AdamW and overflows on both
sides of the checkpoint; an apex-style script (two models, a LARC-style wrapper, two losses,
forced scales, a scheduler); the same kind of script on the `apex` package; examples/checkpoint.py.
"""

import subprocess
import sys

import pytest
import torch

from helpers import DTYPES, OPT_LEVELS, ROOT, TESTS, subprocess_env
from helpers.resume import SCRIPTS

STEPS = {"amp": (8, 4), "apex-style": (8, 4), "apex package": (6, 3), "example": (20, 10)}

CASES = (
    [("amp", level, torch.float16, "fresh process") for level in OPT_LEVELS]
    + [("apex-style", level, dtype, "in-process") for level in OPT_LEVELS for dtype in DTYPES]
    + [("apex package", level, torch.float16, "in-process") for level in OPT_LEVELS]
    + [("example", "O2", torch.float16, "fresh process")]
)


def _fresh_process(script, opt_level, dtype, steps, checkpoint, result):
    name = str(dtype).split(".")[-1]
    if script == "example":  # the example's own child process
        command = [ROOT / "examples" / "checkpoint.py", "--opt-level", opt_level, "--dtype", name]
        command += ["--device", "cpu", "--steps", steps, "--resume", f"{checkpoint}:{result}"]
    else:
        command = [TESTS / "helpers" / "resume.py", script, opt_level, name, steps]
        command += [checkpoint, result]
    completed = subprocess.run(
        [sys.executable, *map(str, command)], capture_output=True, text=True, env=subprocess_env()
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    found = torch.load(result, weights_only=True)
    if script == "example":
        return {"state": found["weights"], "losses": found["losses"]}
    return found


@pytest.mark.parametrize(
    "script, opt_level, dtype, where",
    CASES,
    ids=[f"{s}-{level}-{str(d)[6:]}-{where}" for s, level, d, where in CASES],
)
def test_resume_is_bit_identical(tmp_path, script, opt_level, dtype, where):
    steps, save_at = STEPS[script]
    train = SCRIPTS[script]
    checkpoint = tmp_path / "checkpoint.pt"
    straight = train(opt_level, dtype, steps, save_at=save_at, checkpoint=checkpoint)
    if where == "in-process":
        resumed = train(opt_level, dtype, steps, resume=checkpoint)
    else:
        resumed = _fresh_process(script, opt_level, dtype, steps, checkpoint, tmp_path / "out.pt")
    state = straight["state"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert sorted(resumed["state"]) == sorted(state)
    for key, value in state.items():
        assert torch.equal(resumed["state"][key], value), key
    assert resumed.keys() == straight.keys()
    if "amp" in straight:  # the loss scalers' final state
        assert resumed["amp"] == straight["amp"]
    for per_step in ("losses", "scales"):
        if per_step in straight:
            assert resumed[per_step] == straight[per_step][save_at:]
