"""What the examples share: the --device option, progress bars, a rank's final report."""

import argparse
import os

import torch
from tqdm import tqdm


def device_argument(parser: argparse.ArgumentParser):
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help=f"cpu or cuda (default: {default})")


def progress(iterable, **kwargs):
    """A progress bar on stderr that leaves the results on stdout readable."""
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
