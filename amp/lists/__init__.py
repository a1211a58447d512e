"""The O1 op tables, one module per namespace, and the code that reads them."""

import dataclasses
import importlib

from . import (
    fft_overrides,
    functional_overrides,
    linalg_overrides,
    rnn_overrides,
    tensor_overrides,
    torch_overrides,
)

__all__ = [
    "LOWER_PRECISION",
    "FP32",
    "PROMOTE",
    "SEQUENCE_PROMOTE",
    "BANNED",
    "FLOAT8",
    "TABLES",
    "PROMOTED_BY_TORCH",
    "INPUT_DTYPE",
    "UNPATCHED",
    "LIST_KINDS",
    "NEWER_THAN_TORCH_2_1",
    "NOT_IN_TABLES",
    "Entry",
    "resolve_namespace",
    "entries",
    "float8_entries",
    "delegates",
    "bindings",
    "missing",
]

# The policy kinds, one per list of a table; amp/casting/wrappers.py makes a wrapper for each.
LOWER_PRECISION = "lower_precision"  # FP16_FUNCS: run in the low-precision dtype
FP32 = "fp32"  # FP32_FUNCS: run in float32
PROMOTE = "promote"  # CASTS: run in the widest floating type among the arguments
SEQUENCE_PROMOTE = "sequence_promote"  # SEQUENCE_CASTS: the same over a sequence argument
BANNED = "banned"  # BANNED_FUNCS: refuse low-precision inputs, with advice
# FLOAT8_FUNCS: functions with F.linear's signature whose matmuls run in FP8 where a policy asks
# for float8 (amp.initialize / amp.autocast(float8=...)) and the shapes fit; in the
# low-precision dtype otherwise, so each is in FP16_FUNCS too.
FLOAT8 = "float8"

TABLES = (
    torch_overrides,
    functional_overrides,
    tensor_overrides,
    linalg_overrides,
    fft_overrides,
    rnn_overrides,
)

# Entries torch's type promotion already handles: listed, checked, run as given.
PROMOTED_BY_TORCH = "promoted_by_torch"
# Entries that run in their input's dtype (apex ran some in FP32): listed, checked, run as given.
INPUT_DTYPE = "input_dtype"
# The kinds that run their calls as given. amp patches such an entry only on a device where
# torch's autocast would cast it (agreement.py), to run it as given there too.
UNPATCHED = (PROMOTED_BY_TORCH, INPUT_DTYPE)

# Which list of a table holds which policy kind.
LIST_KINDS = (
    ("FP16_FUNCS", LOWER_PRECISION),
    ("FP32_FUNCS", FP32),
    ("CASTS", PROMOTE),
    ("SEQUENCE_CASTS", SEQUENCE_PROMOTE),
    ("PROMOTED_BY_TORCH", PROMOTED_BY_TORCH),
    ("INPUT_DTYPE_FUNCS", INPUT_DTYPE),
)

# Names that exist only in torch releases newer than 2.1 (amp supports 2.3 and newer). A name
# missing from the installed torch is skipped; one missing and not listed here is a table error.
NEWER_THAN_TORCH_2_1 = {
    ("torch", "rms_norm"): "torch 2.4",
    ("torch.nn.functional", "rms_norm"): "torch 2.4",
    ("torch.linalg", "vecdot"): "torch 2.2",
    ("torch", "_scaled_dot_product_flash_attention"): "CUDA builds of torch 2.1",
}


_BINDING_OF_INTERPOLATE = "a torch._C._nn binding of F.interpolate (C_BINDINGS)"

# Ops torch registers for autocast (CUDA or CPU, torch 2.13) that no table names, and why. A test
# compares this with the installed torch's dispatcher, so a torch upgrade that adds ops is seen.
NOT_IN_TABLES = {
    "_grid_sampler_2d_cpu_fallback": "reached through torch.grid_sampler / F.grid_sample",
    "grid_sampler_2d": "reached through torch.grid_sampler / F.grid_sample",
    "grid_sampler_3d": "reached through torch.grid_sampler / F.grid_sample",
    "_lu_with_info": "private and deprecated; torch.linalg.lu_factor calls the FP32 kernels",
    "_thnn_fused_gru_cell": "not reachable from Python; the cells go through torch._VF",
    "_thnn_fused_lstm_cell": "not reachable from Python; the cells go through torch._VF",
    "mkldnn_rnn_layer": "called from C++ inside torch._VF.lstm, which is patched",
    "multilabel_margin_loss_forward": "reached through F.multilabel_margin_loss",
    "cross_entropy_loss": "a torch._C._nn binding of F.cross_entropy (C_BINDINGS)",
    "nll_loss2d": "a torch._C._nn binding of F.nll_loss (C_BINDINGS)",
    "upsample_nearest1d": _BINDING_OF_INTERPOLATE,
    "upsample_nearest2d": _BINDING_OF_INTERPOLATE,
    "upsample_nearest3d": _BINDING_OF_INTERPOLATE,
    "_upsample_nearest_exact1d": _BINDING_OF_INTERPOLATE,
    "_upsample_nearest_exact2d": _BINDING_OF_INTERPOLATE,
    "_upsample_nearest_exact3d": _BINDING_OF_INTERPOLATE,
    "upsample_linear1d": _BINDING_OF_INTERPOLATE,
    "upsample_bilinear2d": _BINDING_OF_INTERPOLATE,
    "_upsample_bilinear2d_aa": _BINDING_OF_INTERPOLATE,
    "upsample_trilinear3d": _BINDING_OF_INTERPOLATE,
    "upsample_bicubic2d": _BINDING_OF_INTERPOLATE,
    "_upsample_bicubic2d_aa": _BINDING_OF_INTERPOLATE,
    "reflection_pad1d": "a torch._C._nn binding of F.pad (C_BINDINGS)",
    "reflection_pad2d": "a torch._C._nn binding of F.pad (C_BINDINGS)",
    "replication_pad1d": "a torch._C._nn binding of F.pad (C_BINDINGS)",
    "replication_pad2d": "a torch._C._nn binding of F.pad (C_BINDINGS)",
    "replication_pad3d": "a torch._C._nn binding of F.pad (C_BINDINGS)",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    namespace: str  # dotted path, e.g. "torch.nn.functional" or "torch.Tensor"
    name: str
    kind: str
    message: object = None  # the explanation a banned function raises with

    @property
    def qualified_name(self):
        return f"{self.namespace}.{self.name}"


def resolve_namespace(path):
    """The object a dotted namespace path names ("torch.Tensor" is a class inside a module)."""
    try:
        return importlib.import_module(path)
    except ImportError:
        module_path, _, attribute = path.rpartition(".")
        return getattr(importlib.import_module(module_path), attribute)


def entries():
    """Every table entry, in table order."""
    for table in TABLES:
        for list_name, kind in LIST_KINDS:
            for name in getattr(table, list_name):
                yield Entry(table.MODULE, name, kind)
        for name, message in table.BANNED_FUNCS:
            yield Entry(table.MODULE, name, BANNED, message)


def float8_entries():
    """The tables' FLOAT8_FUNCS as entries of kind FLOAT8 (a table without them need not define
    them). They are not among `entries()`: each is listed in FP16_FUNCS as well, which is its
    policy when float8 is off."""
    for table in TABLES:
        for name in getattr(table, "FLOAT8_FUNCS", ()):
            yield Entry(table.MODULE, name, FLOAT8)


def delegates():
    """{(namespace, name): (namespace, name) of the patched entry it passes its tensors to}, from
    the tables' DELEGATES (a table without delegates need not define it)."""
    return {
        (table.MODULE, name): target
        for table in TABLES
        for name, target in getattr(table, "DELEGATES", {}).items()
    }


def bindings():
    """{(namespace, name) of a C binding: (namespace, name) of the function whose policy it
    takes}, from the tables' C_BINDINGS (a table without bindings need not define them)."""
    return {
        (table.C_MODULE, binding): (table.MODULE, name)
        for table in TABLES
        for name, names in getattr(table, "C_BINDINGS", {}).items()
        for binding in names
    }


def missing():
    """The entries whose names the installed torch does not have (skipped when patching)."""
    return [
        entry for entry in entries() if not hasattr(resolve_namespace(entry.namespace), entry.name)
    ]
