"""What the examples share: the --device option and progress bars."""

import argparse

import torch
from tqdm import tqdm


def device_argument(parser: argparse.ArgumentParser):
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help=f"cpu or cuda (default: {default})")


def progress(iterable, **kwargs):
    """A progress bar on stderr that leaves the results on stdout readable."""
    return tqdm(iterable, leave=False, dynamic_ncols=True, **kwargs)
