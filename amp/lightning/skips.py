"""How many optimizer steps amp skipped, learned without making the host wait for the device.

A step's overflow checks (scaling.device_scale.Check) copy their flags to the host asynchronously; the
count takes in the steps whose copies have arrived, in order, and waits for the rest only when
asked for the count itself.
"""

from typing import Any, List, Tuple

__all__ = ["SkipCount", "checks_deciding"]


class SkipCount:
    """The skipped steps of one plugin: `record` each step's checks, `learn` what has arrived."""

    def __init__(self) -> None:
        self._skipped = 0
        self._last_skipped = False
        self._unlearned: List[Tuple[Any, ...]] = []  # each step's checks, oldest first

    def record(self, checks: Tuple[Any, ...]) -> None:
        """Count a step deciding on `checks` (skipped where one found inf/NaN), once known."""
        self._unlearned.append(checks)
        self.learn(wait=False)

    def learn(self, wait: bool) -> None:
        """Count the steps whose checks have reached the host (all, waiting for them, if
        `wait`), in order."""
        learned = 0
        for checks in self._unlearned:
            if not all(check.arrived(wait) for check in checks):
                break
            skipped = any(check.found_value for check in checks)
            self._skipped += skipped
            self._last_skipped = skipped
            learned += 1
        del self._unlearned[:learned]

    @property
    def skipped(self) -> int:
        """The steps skipped (waits for the device's answer about the last ones)."""
        self.learn(wait=True)
        return self._skipped

    @property
    def last_skipped(self) -> bool:
        """Whether the latest step was skipped (waits for the device's answer)."""
        self.learn(wait=True)
        return self._last_skipped

    def reset(self, skipped: int) -> None:
        """Start again from `skipped` steps (a loaded checkpoint's), forgetting unlearned ones."""
        self._unlearned = []
        self._skipped = int(skipped)


def checks_deciding(optimizer: Any) -> Tuple[Any, ...]:
    """The overflow checks the next step of `optimizer` decides on, those of the scale_loss
    blocks since its last step: amp skips the step where one found inf/NaN. Empty for an
    optimizer amp does not step, or for a loss scale that never skips."""
    record = getattr(optimizer, "__dict__", {}).get("_amp_record")
    return tuple(record.pending) if record is not None else ()
