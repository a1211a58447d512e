import pytest


@pytest.fixture(autouse=True)
def no_watch_left(forget_overflows):
    """Every diagnostics test ends with no origin watch armed and no overflow report kept."""
