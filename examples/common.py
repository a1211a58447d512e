"""What the examples share: their argument parser (help with defaults), the --device option,
progress bars, and the distributed examples' options, process group and final report.

This module is imported by the examples; it does nothing on its own. Run an example instead, e.g.
`python examples/demo.py --help`.
"""

import argparse
import os
import sys

import torch
from tqdm import tqdm


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default (unless it has none); the description keeps the
    docstring's lines and examples as written."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS:
            return action.help
        if isinstance(action.default, (list, tuple)):  # as it is typed: O0 O1, not ['O0', 'O1']
            return f"{action.help} (default: {' '.join(map(str, action.default))})"
        return super()._get_help_string(action)


def parser(doc: str) -> argparse.ArgumentParser:
    """The parser of an example whose module docstring is `doc`: `--help` shows the docstring."""
    return argparse.ArgumentParser(description=doc, formatter_class=_HelpFormatter)


def device_argument(parser: argparse.ArgumentParser):
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help="where to train: cpu or cuda")


def dtype_argument(parser: argparse.ArgumentParser, default="float16"):
    parser.add_argument(
        "--dtype",
        default=default,
        choices=["float16", "bfloat16"],
        help="the low-precision type amp computes in",
    )


def opt_level_argument(parser: argparse.ArgumentParser, default):
    parser.add_argument(
        "--opt-level",
        default=default,
        choices=["O0", "O1", "O2", "O3"],
        help="amp's opt level: O0 FP32, O1 casts per op, O2 a low-precision model with FP32 "
        "master weights, O3 all low precision",
    )


def progress(iterable, **kwargs):
    """A progress bar on stderr that leaves the results on stdout readable, shown only where
    stderr is a terminal (disable=None: tqdm decides), so that a log gets no carriage-return
    frames."""
    kwargs.setdefault("disable", None)
    return tqdm(iterable, leave=False, dynamic_ncols=True, **kwargs)


def report_rank(rank, out, state, scales, skipped, accuracy):
    """Print one rank's result and, with `out`, save it as out/rank<N>.pt for comparison."""
    if out:
        os.makedirs(out, exist_ok=True)
        torch.save(
            {"model": state, "scales": scales, "skipped": skipped, "accuracy": accuracy},
            os.path.join(out, f"rank{rank}.pt"),
        )
    print(
        f"rank {rank}: accuracy {accuracy:.4f}, skipped steps {skipped}, final loss scale {scales[-1]}",
        flush=True,
    )


def leave_rank():
    """End a rank's process once its results are printed and saved: output flushed, then
    os._exit(0), skipping the C++ static destructors of a normal exit, in which torch's gloo
    backend aborts now and then ("terminate called without an active exception"), amp or not."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def distributed_arguments(parser: argparse.ArgumentParser):
    """The options ddp.py and fsdp2.py share."""
    dtype_argument(parser)
    parser.add_argument("--steps", type=int, default=50, help="training steps")
    parser.add_argument(
        "--inject-overflow-rank",
        type=int,
        default=-1,
        help="the rank whose gradients get an inf at --inject-overflow-step; -1 for none",
    )
    parser.add_argument(
        "--inject-overflow-step",
        type=int,
        default=-1,
        help="the step at which that rank's gradients get an inf; -1 for none",
    )
    parser.add_argument("--out", help="folder for each rank's final state (rank<N>.pt)")


def init_distributed(device_type):
    """Join torchrun's process group (NCCL on GPUs, gloo on CPU): (rank, world size, device)."""
    import torch.distributed as dist

    cuda = device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


if __name__ == "__main__":
    parser(__doc__).parse_args()
    print(__doc__.strip(), file=sys.stderr)
