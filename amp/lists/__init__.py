"""The O1 op tables, one module per namespace, and the code that reads them."""

import dataclasses
import importlib

from ..wrappers import BANNED, FP32, LOWER_PRECISION, PROMOTE, SEQUENCE_PROMOTE
from . import (
    functional_overrides,
    linalg_overrides,
    rnn_overrides,
    tensor_overrides,
    torch_overrides,
)

TABLES = (
    torch_overrides,
    functional_overrides,
    tensor_overrides,
    linalg_overrides,
    rnn_overrides,
)

# Which list of a table holds which policy kind.
LIST_KINDS = (
    ("FP16_FUNCS", LOWER_PRECISION),
    ("FP32_FUNCS", FP32),
    ("CASTS", PROMOTE),
    ("SEQUENCE_CASTS", SEQUENCE_PROMOTE),
)

# Names that exist only in newer torch releases than the oldest one amp supports (2.1). A name
# missing from the installed torch is skipped; one missing and not listed here is a table error.
NEWER_THAN_TORCH_2_1 = {
    ("torch", "rms_norm"): "torch 2.4",
    ("torch.nn.functional", "rms_norm"): "torch 2.4",
    ("torch.linalg", "vecdot"): "torch 2.2",
    ("torch", "_scaled_dot_product_flash_attention"): "CUDA builds of torch 2.1",
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


def missing():
    """The entries whose names the installed torch does not have (skipped when patching)."""
    return [
        entry
        for entry in entries()
        if not hasattr(resolve_namespace(entry.namespace), entry.name)
    ]
