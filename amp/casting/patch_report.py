"""The ops amp patches at O1 and why: where its tables decide otherwise than torch's autocast on a
device type (lists/agreement.py), grouped by the reason, as docs/opt-levels.md shows them.

    python -m amp.casting.patch_report     # that table, regenerated

tests/casting/test_patch_report.py keeps docs/opt-levels.md's copy equal to `markdown()`.
"""

from ..lists import agreement
from .torch_patches import TorchPatches

__all__ = ["rows", "markdown"]

_DEVICES = ("cpu", "cuda")
_NAMES = {"cpu": "CPU", "cuda": "CUDA"}


def _cell(kind, op, device):
    decided = agreement.decision(kind, op, device)
    if decided == agreement.TORCH:
        return "torch's autocast decides (the same)"
    alone = " (torch's autocast off in the call)" if decided == agreement.AMP_ALONE else ""
    return agreement.reason(kind, op, device) + alone


def rows():
    """[(kind, {device type: why}, [qualified names])]: the entries, C bindings and
    registrations amp patches at O1 (no float8, no trace open), grouped by what happens on each
    device type, in table order."""
    groups = {}
    for _, _, kind, _, display, op in TorchPatches().steps():
        key = (kind, tuple(_cell(kind, op, device) for device in _DEVICES))
        groups.setdefault(key, []).append(display)
    return [
        (kind, dict(zip(_DEVICES, cells)), names) for (kind, cells), names in groups.items()
    ]


def markdown():
    """The table of the ops amp patches at O1 (docs/opt-levels.md)."""
    lines = [
        "| amp's table | " + " | ".join(_NAMES[d] for d in _DEVICES) + " | ops |",
        "|---|" + "---|" * len(_DEVICES) + "---|",
    ]
    for kind, cells, names in rows():
        ops = ", ".join(f"`{name}`" for name in names)
        lines.append(f"| {kind} | " + " | ".join(cells[d] for d in _DEVICES) + f" | {ops} |")
    count = sum(len(names) for _, _, names in rows())
    lines.append("")
    lines.append(f"{count} functions patched; every other op of the tables is torch's to cast.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
