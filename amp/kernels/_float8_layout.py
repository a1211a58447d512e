"""Launch metadata for float8.cu: the numpy mirror of its by-value Meta (the jobs of one launch),
the packing of jobs into Metas, and the launch constants. Importable without CUDA or CuPy.
"""

from typing import List, Sequence

import numpy as np

__all__ = ["JOBS", "TILE", "THREADS", "META", "POINTERS", "compile_options", "tiles", "metas"]

JOBS = 24  # matrices per launch: the Meta stays within 4 KB of kernel parameters on every GPU
TILE = 128  # rows and columns of a tile (kTile)
THREADS = 256  # threads per block (kThreads)
POINTERS = ("src", "out", "out_t", "amax", "amax_t", "scale", "inverse", "scale_t", "inverse_t")
_JOB = np.dtype(
    [(name, np.uint64) for name in POINTERS]
    + [("rows", np.int64), ("cols", np.int64), ("first_tile", np.int64)]
    + [("per_row", np.int32), ("per_col", np.int32)],
    align=True,
)
META = np.dtype([("jobs", _JOB, (JOBS,)), ("tiles", np.int64), ("njobs", np.int32)], align=True)


def compile_options() -> tuple:
    """The -D options that size float8.cu's Meta and check it against META."""
    return (f"-DAMP_F8_JOBS={JOBS}", f"-DAMP_F8_META_BYTES={META.itemsize}")


def tiles(rows: int, cols: int) -> int:
    """The tiles a rows x cols matrix takes."""
    return -(-rows // TILE) * -(-cols // TILE)


def _pointer(tensor):
    return 0 if tensor is None else tensor.data_ptr()


def metas(jobs: Sequence) -> List[tuple]:
    """(Meta, tiles) per launch, at most JOBS jobs each, for amp/kernels/float8.py's Jobs."""
    packed = []
    for start in range(0, len(jobs), JOBS):
        meta = np.zeros(1, dtype=META)
        record = meta[0]
        first = 0
        for slot, job in enumerate(jobs[start : start + JOBS]):
            entry = record["jobs"][slot]
            for name in POINTERS:
                entry[name] = _pointer(getattr(job, name))
            rows, cols = job.src.shape
            entry["rows"], entry["cols"], entry["first_tile"] = rows, cols, first
            entry["per_row"], entry["per_col"] = job.per_row, job.per_col
            first += tiles(rows, cols)
        record["tiles"], record["njobs"] = first, min(JOBS, len(jobs) - start)
        packed.append((meta, first))
    return packed
