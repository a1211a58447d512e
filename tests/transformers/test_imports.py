"""Transformers stays optional: neither `import amp` nor `import amp.transformers` imports it (or
Accelerate); only `from amp.transformers import AmpTrainer` does."""

import subprocess
import sys

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
