"""Transformers stays optional: neither `import amp` nor `import amp.transformers` imports it (or
Accelerate); only `from amp.transformers import AmpTrainer` does."""

import subprocess
import sys

import pytest

import amp.transformers
from helpers import subprocess_env


def test_importing_amp_or_amp_transformers_does_not_import_transformers():
    code = (
        "import sys, amp, amp.transformers; "
        "assert not any(m.split('.')[0] in ('transformers', 'accelerate') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "hidden", [("transformers", "accelerate"), ("accelerate",), ("transformers",)]
)
def test_without_the_extra_importing_amptrainer_names_the_extra(hidden, monkeypatch):
    for name in hidden:  # as if not installed: `import name` raises ModuleNotFoundError
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "amp.transformers.trainer", raising=False)
    monkeypatch.delitem(vars(amp.transformers), "AmpTrainer", raising=False)  # made anew
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'amp\[transformers\]'") as error:
        from amp.transformers import AmpTrainer  # noqa: F401
    # trainer.py imports accelerate first: the first hidden one it meets is named
    missing = "accelerate" if "accelerate" in hidden else "transformers"
    assert f"{missing!r} is not installed" in str(error.value)
    assert error.value.name == missing
