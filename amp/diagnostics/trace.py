"""amp.trace(): a record of every patched call made in a region, the policy that applied and the
dtypes before and after."""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Optional, Tuple

import torch

from .._state import amp_state
from ..lists import FLOAT8

__all__ = ["TraceRecord", "Trace", "traced_call", "trace"]


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


def _floating_dtypes(values):
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.append(value.dtype)
        elif isinstance(value, (list, tuple)):
            found.extend(_floating_dtypes(value))
    return found


@dataclasses.dataclass(frozen=True)
class TraceRecord:
    """One patched call: the op, the policy that applied, and the dtypes before and after."""

    op: str
    policy: str  # the table kind, e.g. "lower_precision" or "float8"; "off" when none applied
    input_dtypes: Tuple[torch.dtype, ...]
    ran_in: Optional[torch.dtype]
    output_dtype: Optional[torch.dtype]

    @property
    def cast(self):
        """Whether amp changed the dtype of any input."""
        return any(dtype is not self.ran_in for dtype in self.input_dtypes)


class Trace:
    """The records of one `amp.trace()` region; prints as a table."""

    def __init__(self):
        self.records = []

    def __len__(self):
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def ops(self):
        """The names of the ops recorded, in call order."""
        return [record.op for record in self.records]

    def __str__(self):
        header = ("op", "policy", "inputs", "ran in", "output")
        rows = [
            (
                record.op,
                record.policy,
                ", ".join(_dtype_name(dtype) for dtype in record.input_dtypes) or "-",
                _dtype_name(record.ran_in),
                _dtype_name(record.output_dtype),
            )
            for record in self.records
        ]
        widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [header] + rows
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        casts = sum(record.cast for record in self.records)
        lines.append(f"{len(self.records)} patched calls, {casts} with casts")
        return "\n".join(lines)

    __repr__ = __str__


def _applies(policy, kind):
    """Whether `policy` (None: no casting) decides calls of `kind`: a policy with a float8 recipe
    and no dtype (O2/O3 with float8) decides only the FP8 ones."""
    if policy is None:
        return False
    return kind == FLOAT8 or policy.cpu is not None or policy.cuda is not None


def traced_call(original, name, kind, policy, new, args, kwargs, ran_in=None):
    """Run a patched call and record it in the thread's active trace. `ran_in`: the dtype it
    computes in where its arguments do not say (an FP8 matmul takes them in higher precision)."""
    call_args, call_kwargs = (args, kwargs) if new is None else new
    result = original(*call_args, **call_kwargs)
    inputs = tuple(_floating_dtypes(args) + _floating_dtypes(kwargs.values()))
    explicit = kwargs.get("dtype") if kwargs else None
    ran_in = (
        ran_in
        or explicit
        or next(iter(_floating_dtypes(call_args) + _floating_dtypes(call_kwargs.values())), None)
    )
    outputs = _floating_dtypes(result if isinstance(result, (list, tuple)) else (result,))
    amp_state.thread.trace.records.append(
        TraceRecord(
            op=name,
            policy=kind if _applies(policy, kind) else "off",
            input_dtypes=inputs,
            ran_in=ran_in,
            output_dtype=outputs[0] if outputs else None,
        )
    )
    return result


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record every call of an op amp's tables decide made in this thread inside the block
    (while a block is open, amp casts each such call itself, where torch's autocast would have).

    Example::

        with amp.trace() as t:
            loss = model(x).sum()
        print(t)                      # a table: op, policy, input dtypes, dtype it ran in, output
        t.records[0].ran_in           # torch.float16
    """
    thread = amp_state.thread
    outer = thread.trace
    current = Trace()
    with amp_state.lock:
        amp_state.traces += 1
        amp_state.active = True
        amp_state.torch_patches.tracing_changed()  # every table entry wrapped while tracing
    thread.trace = current
    try:
        yield current
    finally:
        thread.trace = outer
        with amp_state.lock:
            amp_state.traces -= 1
            amp_state.refresh_active()
            amp_state.torch_patches.tracing_changed()
        if outer is not None:
            outer.records.extend(current.records)
