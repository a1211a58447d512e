"""amp.lightning.skips: the plugin's count of skipped steps, learned as the checks arrive."""

import types

from amp.lightning.skips import SkipCount, checks_deciding


class _Check:
    """A check whose flag reaches the host when `arrive()` is called (or a waiting read)."""

    def __init__(self, found):
        self.found_value = found
        self.here = False
        self.waited = 0

    def arrive(self):
        self.here = True

    def arrived(self, wait):
        if wait and not self.here:
            self.waited += 1
            self.here = True
        return self.here


def test_a_step_is_counted_once_its_checks_arrive_in_order_without_waiting():
    count = SkipCount()
    first, second = _Check(True), _Check(False)
    count.record((first,))
    count.record((second,))
    second.arrive()
    count.learn(wait=False)
    assert count._skipped == 0  # the second may not be counted before the first
    first.arrive()
    count.learn(wait=False)
    assert (count._skipped, count._last_skipped) == (1, False)
    assert first.waited == second.waited == 0


def test_asking_for_the_count_waits_for_every_step_one_found_inf_skips():
    count = SkipCount()
    checks = (_Check(False), _Check(True))
    count.record(checks)
    assert count.skipped == 1 and count.last_skipped
    assert sum(check.waited for check in checks) == 2
    count.record((_Check(False),))
    assert count.skipped == 1 and not count.last_skipped


def test_a_reset_forgets_the_steps_not_yet_learned():
    count = SkipCount()
    count.record((_Check(True),))
    count.reset(5)
    assert count.skipped == 5


def test_an_optimizer_amp_does_not_step_decides_on_no_checks():
    assert checks_deciding(object()) == ()
    optimizer = types.SimpleNamespace(_amp_record=types.SimpleNamespace(pending=["a", "b"]))
    assert checks_deciding(optimizer) == ("a", "b")
