"""The audit's report: one row per module, worst first; a table; what to keep in FP32."""

import dataclasses
import math
from typing import List, Optional

__all__ = ["HEADROOM_MARGIN", "UNDERFLOW_LIMIT", "FLOAT8_ERROR_LIMIT", "AuditRow", "AuditReport"]

# A module whose largest FP32 output is within this factor of the dtype's max keeps no room for
# the growth of a few more steps: keep it in FP32.
HEADROOM_MARGIN = 2.0
UNDERFLOW_LIMIT = 0.01  # fraction of values flushed to zero above which precision is lost
# A module whose FP8 output is further than this from FP32 (relative error; 20 dB of SQNR, where
# torchao's own tests of an FP8 linear ask for 18-25 dB) is better kept out of FP8.
FLOAT8_ERROR_LIMIT = 0.1


@dataclasses.dataclass(frozen=True)
class AuditRow:
    """One module's output, measured in FP32 and in the audit's low-precision dtype."""

    module: str  # qualified name as in named_modules() ("" is the model itself)
    op: str  # the module's class
    calls: int  # how often the forward called it
    headroom: float  # dtype max / max |FP32 output| (inf for an all-zero output; < 1 overflows)
    relative_error: float  # ||low - FP32|| / ||FP32|| over its outputs (inf when low is not finite)
    underflow: float  # fraction of the FP32 output's nonzero values the dtype flushes to zero
    # fraction of the nonzero gradients of its output that the dtype flushes to zero once
    # multiplied by the loss scale; None when the loss has no gradient (a no_grad forward)
    grad_underflow: Optional[float]
    order: int = dataclasses.field(default=0, repr=False)  # when it first returned, in the FP32 run

    @property
    def overflows(self):
        return self.headroom < 1.0

    def _sort_key(self):
        error = self.relative_error if math.isfinite(self.relative_error) else math.inf
        return (
            not self.overflows,
            self.headroom >= HEADROOM_MARGIN,
            -error,
            -self.underflow,
            self.order,  # of modules alike, the first to return: the others follow from it
        )


def _number(value, digits=3):
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}"


class AuditReport:
    """What `amp.audit` measured: `.rows` worst first; `str()` a table; `suggest()` advice."""

    def __init__(self, rows: List[AuditRow], dtype, loss_scale, loss_fp32, loss_low, float8=None):
        self.rows = sorted(rows, key=AuditRow._sort_key)
        self.dtype = dtype
        self.float8 = float8  # the recipe F.linear ran in FP8 with, or None
        self.loss_scale = loss_scale
        self.loss_fp32 = loss_fp32  # the loss fn() returned, in FP32 and in `dtype`
        self.loss_low = loss_low

    def row(self, module):
        """The row of the module named `module`."""
        for row in self.rows:
            if row.module == module:
                return row
        raise KeyError(f"no module named {module!r} ran in the audited forward")

    def __str__(self):
        dtype = str(self.dtype).replace("torch.", "")
        header = ("module", "class", "headroom", "rel. error", "underflow", "grad underflow")
        lines = [
            (
                row.module or "(model)",
                row.op,
                _number(row.headroom),
                _number(row.relative_error, 2),
                f"{row.underflow:.1%}",
                "-" if row.grad_underflow is None else f"{row.grad_underflow:.1%}",
            )
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in [header] + lines) for i in range(len(header))]
        table = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
            for line in [header] + lines
        ]
        table.insert(1, "  ".join("-" * width for width in widths))
        low = dtype if self.float8 is None else f"float8 ({self.float8}, {dtype} around it)"
        table.insert(
            0,
            f"amp.audit: {low} against float32, loss scale {self.loss_scale:g}; loss "
            f"{self.loss_fp32:.6g} in float32, {self.loss_low:.6g} in {low}",
        )
        if self.float8 is not None:
            table.insert(1, "each module ran on its float32 inputs: its error is the one FP8 adds")
        return "\n".join(table)

    def _flagged(self, row):
        if row.headroom < HEADROOM_MARGIN or row.underflow > UNDERFLOW_LIMIT:
            return True
        return self.float8 is not None and row.relative_error > FLOAT8_ERROR_LIMIT

    __repr__ = __str__

    def keep_fp32(self):
        """The modules to keep in FP32, as `fp32_modules` takes them.

        A module is flagged when its output overflows the dtype or comes within a factor
        HEADROOM_MARGIN of its max, or loses more than UNDERFLOW_LIMIT of its values to zero, or
        (a float8 audit) is further than FLOAT8_ERROR_LIMIT from FP32.
        A module whose submodules that ran are all flagged (with itself) is named instead of
        them; a flagged module with healthy parts is left to its flagged parts; never the whole
        model.
        """
        flagged = {row.module for row in self.rows if self._flagged(row)}
        names = [row.module for row in self.rows]

        def whole(name):
            kids = [n for n in names if n != name and n.rpartition(".")[0] == name]
            return name in flagged and all(whole(kid) for kid in kids)

        return [
            name
            for name in names
            if name and whole(name) and not any(whole(parent) for parent in _parents(name))
        ]

    def suggest(self):
        """Plain advice: what to keep in FP32 and the `fp32_modules` argument that does it."""
        dtype = str(self.dtype).replace("torch.", "")
        keep = self.keep_fp32()
        lines = []
        for name in keep:
            row = self.row(name)
            if row.headroom < HEADROOM_MARGIN:
                why = (
                    f"its output overflows {dtype}"
                    if row.overflows
                    else f"its output comes within {row.headroom:.3g}x of {dtype}'s max"
                )
            elif row.underflow > UNDERFLOW_LIMIT:
                why = f"{row.underflow:.1%} of its output underflows to zero in {dtype}"
            else:
                why = (
                    f"in float8 ({self.float8}) its output is {row.relative_error:.3g} from "
                    "FP32's, relative"
                )
            lines.append(f"- keep {name or '(the whole model)'} ({row.op}) in FP32: {why}")
        if keep:
            patterns = ", ".join(repr(name) for name in keep)
            lines.append(
                f"amp.initialize(model, optimizer, opt_level=..., fp32_modules=[{patterns}]) "
                "does it (O1: no casting inside them; O2/O3: FP32 weights, inputs and outputs "
                "cast around them)."
            )
            if any(self.row(name).overflows for name in keep):
                lines.append(
                    f"At O2/O3 a kept module's output goes back to {dtype} for the modules after "
                    f"it and overflows there again: train at O1 (fp32_modules=[{patterns}]), or "
                    "keep in FP32 a module that holds it and the modules that take its output."
                )
            if self.float8 is not None and self.float8 != "rowwise":
                lines.append(
                    "Or try float8='rowwise': a scale per row keeps an outlier from taking the "
                    "range of the whole tensor."
                )
        else:
            fits = dtype if self.float8 is None else f"float8 ({self.float8})"
            lines.append(f"Nothing needs to stay in FP32: every module fits {fits}.")
        starving = [
            row.module or "(model)"
            for row in self.rows
            if row.grad_underflow is not None and row.grad_underflow > UNDERFLOW_LIMIT
        ]
        if starving:
            lines.append(
                f"At loss scale {self.loss_scale:g} the gradients of {', '.join(starving[:5])}"
                f"{' ...' if len(starving) > 5 else ''} partly underflow in {dtype}: a dynamic "
                "loss scale grows to fix it by itself; a static one should be larger."
            )
        return "\n".join(lines)


def _parents(name):
    """The qualified names of the modules above `name`, the model itself ("") left out."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]
