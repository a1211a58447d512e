import pytest


@pytest.fixture(autouse=True)
def no_watch_left(forget_overflows):
    """Every audit test ends with no origin watch armed and no overflow report kept (the audit
    pauses the watch of a skipped step; a test that skips arms it)."""
