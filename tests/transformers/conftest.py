"""Every AmpTrainer test runs torch on one thread: the tiny GPT-2 steps several times faster so on
a busy 2-core machine, and bit-for-bit comparisons fix the kernels' vector/scalar split."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
