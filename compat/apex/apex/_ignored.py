"""apex arguments this package accepts and ignores: a warning, once per argument and process.

They changed how apex ran (buckets and streams, CUDA-graph capture, memory), never results;
code passing them still runs, and learns that they do nothing here.
"""

import warnings

__all__ = ["ApexCompatWarning", "warn_ignored"]


class ApexCompatWarning(UserWarning):
    """An apex argument accepted by amp's apex package that has no effect here."""


_warned: set[tuple[str, str]] = set()


def warn_ignored(
    owner: str, why: str, given: dict[str, object], defaults: dict[str, object]
) -> None:
    """Warn for each argument in `given` whose value is not apex's default, the first time."""
    for name, value in given.items():
        if value == defaults[name] or (owner, name) in _warned:
            continue
        _warned.add((owner, name))
        warnings.warn(
            f"{owner}: {name}={value!r} is accepted and has no effect here: {why}. Leave it out "
            "to silence this (amp's apex package warns once per argument; the category is "
            "apex.ApexCompatWarning).",
            ApexCompatWarning,
            stacklevel=3,
        )
