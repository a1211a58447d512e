"""apex arguments accepted with no effect (apex/_ignored.py): ApexCompatWarning, once per
argument and process, only for a value other than apex's default."""

import json
import subprocess
import sys
import textwrap

import apex
import pytest
from helpers import subprocess_env

# Each line of output: the warnings one statement raised, as [(category, message, filename)].
_PROGRAM = textwrap.dedent(
    """
    import json, os, tempfile, warnings
    import torch
    import torch.distributed as dist
    import apex
    from apex.normalization import FusedLayerNorm, FusedRMSNorm
    from apex.optimizers import FusedAdam, FusedSGD
    from apex.parallel import DistributedDataParallel

    warnings.simplefilter("always")
    params = [torch.nn.Parameter(torch.zeros(2))]
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    def run(statement):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eval(statement)
        print(json.dumps([
            (w.category.__name__, str(w.message), w.filename)
            for w in caught if issubclass(w.category, apex.ApexCompatWarning)
        ]))

    for statement in STATEMENTS:
        run(statement)
    dist.destroy_process_group()
    """
)

STATEMENTS = [
    "FusedAdam(params, capturable=True)",
    "FusedAdam(params, capturable=True)",
    "FusedAdam(params, capturable=False)",
    "FusedSGD(params, lr=0.1, materialize_master_grads=False)",
    "FusedLayerNorm(2, memory_efficient=True)",
    "FusedRMSNorm(2, memory_efficient=True)",
    "FusedLayerNorm(2, memory_efficient=True)",
    "DistributedDataParallel(torch.nn.Linear(2, 2), message_size=10000000, delay_allreduce=False)",
    "DistributedDataParallel(torch.nn.Linear(2, 2), message_size=1, delay_allreduce=True)",
    "DistributedDataParallel(torch.nn.Linear(2, 2), message_size=2, prof=True)",
]


@pytest.fixture(scope="module")
def caught():
    """The ApexCompatWarnings each statement raised, as [(category, message, filename)]."""
    code = _PROGRAM.replace("STATEMENTS", repr(STATEMENTS))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_each_ignored_argument_warns_once_and_defaults_never(caught):
    messages = [[message for _, message, _ in found] for found in caught]
    first, second, default = messages[:3]
    assert len(first) == 1
    assert "FusedAdam: capturable=True is accepted and has no effect" in first[0]
    assert second == [] and default == []
    assert "materialize_master_grads=False" in messages[3][0]
    assert "FusedLayerNorm: memory_efficient=True" in messages[4][0]
    assert "FusedRMSNorm: memory_efficient=True" in messages[5][0]
    assert messages[6] == []
    assert messages[7] == []  # apex's defaults, written out
    assert [message.split(" is accepted")[0] for message in messages[8]] == [
        "apex.parallel.DistributedDataParallel: message_size=1",
        "apex.parallel.DistributedDataParallel: delay_allreduce=True",
    ]
    assert [message.split(" is accepted")[0] for message in messages[9]] == [
        "apex.parallel.DistributedDataParallel: prof=True"  # message_size warned already
    ]


def test_the_warning_points_at_the_caller(caught):
    assert {filename for _, _, filename in caught[0]} == {"<string>"}
    assert caught[0][0][0] == "ApexCompatWarning"
    assert issubclass(apex.ApexCompatWarning, UserWarning)
