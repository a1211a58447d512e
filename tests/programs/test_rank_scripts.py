"""The scripts run as one rank of a multi-process job (the tests' rank helpers, the distributed
examples) leave with os._exit once their results are written: torch's gloo backend aborts now and
then in the C++ static destructors of a normal exit ("terminate called without an active
exception", SIGABRT; plain DDP without amp too), which failed jobs whose work was done."""

import ast
import subprocess
import sys

import pytest

from helpers import ROOT, TESTS, subprocess_env

RANK_SCRIPTS = [
    "tests/helpers/apex_scripts/ddp.py",
    "tests/helpers/ddp_masters_rank.py",
    "tests/helpers/distributed_scenarios.py",
    "tests/helpers/float8_ranks.py",
    "tests/helpers/fsdp2_fake_ranks.py",
    "tests/helpers/fsdp2_ranks.py",
    "tests/helpers/origin_ddp_rank.py",
    "tests/lightning/lightning_ddp_rank.py",
    "examples/ddp.py",
    "examples/fsdp2.py",
    "benchmarks/fsdp2_memory.py",
]
# What makes a script a rank: a process group of its own, or Lightning's DDP across processes.
_RANK_MARKS = ("init_process_group(", "init_distributed(", 'strategy="ddp"')
_LEAVES = ("ranks.leave", "leave_rank")


def _main_block(tree):
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return node
    return None


def test_every_script_that_runs_as_a_rank_is_listed():
    found = set()
    for folder in ("tests", "examples", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            source = path.read_text()
            if any(mark in source for mark in _RANK_MARKS) and _main_block(ast.parse(source)):
                found.add(str(path.relative_to(ROOT)))
    found.discard("examples/common.py")  # defines init_distributed; its main answers --help
    assert found == set(RANK_SCRIPTS)


@pytest.mark.parametrize("script", RANK_SCRIPTS)
def test_a_rank_leaves_by_os_exit_once_its_results_are_written(script):
    block = _main_block(ast.parse((ROOT / script).read_text()))
    last = block.body[-1]
    assert isinstance(last, ast.Expr) and ast.unparse(last.value) in [f"{f}()" for f in _LEAVES]


@pytest.mark.parametrize(
    "leave", ["from helpers.ranks import leave", "from common import leave_rank as leave"]
)
def test_leaving_flushes_the_output_and_runs_no_exit_handlers(leave):
    code = (
        f"import atexit, sys; {leave}; "
        "atexit.register(lambda: print('exit handlers ran')); "
        "print('results', end=''); sys.stderr.write('log'); leave(); print('after')"
    )
    env = subprocess_env()
    env["PYTHONPATH"] = f"{ROOT / 'examples'}:{TESTS}:{env['PYTHONPATH']}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "results", "log")
