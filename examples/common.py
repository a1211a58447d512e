"""What the examples share: the --device option, progress bars, and the distributed examples'
options, process group and final report."""

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


def distributed_arguments(parser: argparse.ArgumentParser):
    """The options ddp.py and fsdp2.py share."""
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--inject-overflow-rank", type=int, default=-1)
    parser.add_argument("--inject-overflow-step", type=int, default=-1)
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
