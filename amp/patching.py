"""The patch ledger: every change amp makes to objects it does not own, and its undo, restored LIFO."""

import dataclasses
import warnings

import wrapt

__all__ = [
    "ORIGINAL_ATTRIBUTE",
    "is_amp_replacement",
    "qualified_name",
    "AttributePatch",
    "Undo",
    "PatchLedger",
]

# Replacement functions carry their original here, for tests and readers (amp's wrappers set it).
ORIGINAL_ATTRIBUTE = "__amp_original__"

# id -> replacement, for every replacement a ledger has installed and not undone. amp knows its
# own patches by identity: an attribute would be copied by a tool that wraps a patched function
# (functools.wraps copies __dict__, wrapt proxies attribute reads), and the copy would then look
# like a patch of amp's forever, refusing every later initialize.
_INSTALLED = {}


def is_amp_replacement(obj):
    """Whether `obj` is a replacement that amp installed and has not undone."""
    return _INSTALLED.get(id(obj)) is obj


def qualified_name(parent, attribute):
    name = getattr(parent, "__qualname__", None) or getattr(parent, "__name__", None)
    if name is None:
        name = type(parent).__name__
    module = getattr(parent, "__module__", None)
    if isinstance(parent, type) and module and not name.startswith(module):
        name = f"{module}.{name}"
    return f"{name}.{attribute}"


def _current_value(parent, attribute):
    # Read without binding: on a class, `getattr` would hand back a bound/unbound method rather
    # than the object we stored (wrapt's docs warn about restoring from such a read).
    return vars(parent).get(attribute)


@dataclasses.dataclass(frozen=True, slots=True)
class AttributePatch:
    parent: object
    attribute: str
    original: object
    replacement: object
    owned: bool  # the attribute was in vars(parent) before; else it was inherited or dynamic

    def undo(self):
        if _INSTALLED.get(id(self.replacement)) is self.replacement:
            del _INSTALLED[id(self.replacement)]
        current = vars(self.parent).get(self.attribute)
        if current is not self.replacement:
            ours = getattr(self.replacement, "__func__", self.replacement)
            if getattr(current, "__wrapped__", None) is ours:
                # Wrapped by someone after us (an LR scheduler wraps optimizer.step); their
                # wrapper calls ours, which amp made inert, so it can stay.
                return
            warnings.warn(
                f"amp could not restore {qualified_name(self.parent, self.attribute)}: it was "
                "replaced after amp patched it. Leaving the newer value in place.",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        if self.owned:
            setattr(self.parent, self.attribute, self.original)
        else:
            delattr(self.parent, self.attribute)


@dataclasses.dataclass(frozen=True)
class Undo:
    description: str
    undo: object  # a callable taking no arguments


class PatchLedger:
    """Applies patches and records how to undo them; `restore` undoes everything, newest first."""

    def __init__(self):
        self._entries = []

    def __len__(self):
        return len(self._entries)

    def patch(self, target, name, make_replacement):
        """Replace `target.name` by `make_replacement(original)`; return the AttributePatch."""
        parent, attribute, original = wrapt.resolve_path(target, name)
        if is_amp_replacement(_current_value(parent, attribute) or original):
            raise RuntimeError(
                f"{qualified_name(parent, attribute)} is already patched by amp; call "
                "amp.deinitialize() (or leave the autocast region) before patching it again."
            )
        # resolve_path reads classes through vars() along the MRO, so `original` is the raw
        # function or descriptor, which is what must be put back.
        replacement = make_replacement(original)
        patch = AttributePatch(parent, attribute, original, replacement, attribute in vars(parent))
        self.reapply(patch)
        return patch

    def reapply(self, patch):
        """Install a recorded AttributePatch (again); its replacement object is reused."""
        setattr(patch.parent, patch.attribute, patch.replacement)
        _INSTALLED[id(patch.replacement)] = patch.replacement
        self._entries.append(patch)

    def reapply_all(self, patches):
        """Install recorded AttributePatches again; return those built against other values.

        A patch whose attribute changed since it was built (someone else patched torch in the
        meantime) is not installed: the caller rebuilds it against the current value.
        """
        stale = []
        for patch in patches:
            current = vars(patch.parent).get(patch.attribute)
            if current is patch.original if patch.owned else current is None:
                self.reapply(patch)
            else:
                stale.append(patch)
        return stale

    def add_undo(self, description, undo):
        self._entries.append(Undo(description, undo))

    def add_hook(self, handle, description):
        self.add_undo(description, handle.remove)

    def restore(self):
        """Undo every entry, newest first. Every entry is tried; the first error is re-raised."""
        first_error = None
        while self._entries:
            entry = self._entries.pop()
            try:
                entry.undo()
            except Exception as error:  # keep undoing the rest, then report
                if first_error is None:
                    first_error = error
        if first_error is not None:
            raise first_error
