"""Two-rank gloo jobs for the tests: a free port, a helper script run as ranks 0 and 1, and how
such a rank ends."""

import os
import socket
import subprocess
import sys

from helpers import subprocess_env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(script, *args, timeout=240):
    """Run `script` (with `args`) as ranks 0 and 1 of a gloo job; fail with a rank's log tail if
    either exits non-zero."""
    run_ranks(script, *args, world=2, timeout=timeout)


def run_ranks(script, *args, world, timeout=240):
    """run_two_ranks for a gloo job of `world` ranks."""
    env = subprocess_env(
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
    )
    processes = [
        subprocess.Popen(
            [sys.executable, script, *map(str, args)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = [process.communicate(timeout=timeout)[0] for process in processes]
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log[-3000:]


def leave():
    """End this rank's process once its results are written: output flushed, then os._exit(0).

    Without the C++ static destructors of a normal exit: torch's gloo backend aborts in them now
    and then ("terminate called without an active exception", SIGABRT; 2 runs in 38 of plain DDP
    without amp, destroy_process_group() or not), which failed a job whose results were written.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
