"""The reports of skipped steps (amp/weights/skip.py): the message, amp.last_overflow(), the origin
watch of the step after, the non-finite-loss warning, and the skips the device took reported once
their copies have arrived."""

import logging

import pytest
import torch

import amp
from amp._state import amp_state
from amp.scaling.scaler import LossScaler
from amp.weights.skip import Skips

pytestmark = pytest.mark.usefixtures("forget_overflows")


@pytest.fixture(autouse=True)
def no_run_of_bad_losses():
    """Each test starts and ends outside a run of non-finite losses (the warning's state)."""
    yield
    amp_state.nonfinite_loss_run = None


def checked_block(scaler, overflow, loss=1.0, loss_id=0):
    """A block's check as scale_loss's exit leaves it: the gradients' flag, the update."""
    check = scaler.open_check(loss_id, torch.device("cpu"))
    check.found.fill_(float(overflow))
    scaler.update(check, torch.tensor(loss))
    return check


def test_a_skipped_step_is_reported_with_its_parameters_and_the_scale_after(caplog):
    skips, scaler = Skips(), LossScaler("dynamic")
    check = checked_block(scaler, overflow=True)
    with caplog.at_level(logging.INFO, logger="amp"):
        skips.skipped([check], ("encoder.weight",))
    report = amp.last_overflow()
    assert (report.loss_id, report.params, report.loss_scale) == (0, ("encoder.weight",), 32768.0)
    assert not report.nonfinite_loss
    assert caplog.messages == [
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    ]
    assert amp_state.origin_watch.armed  # the next step is watched


def test_a_non_finite_loss_keeps_the_scale_and_says_so(caplog):
    skips, scaler = Skips(), LossScaler("dynamic")
    with caplog.at_level(logging.INFO, logger="amp"):
        skips.skipped([checked_block(scaler, overflow=True, loss=float("nan"))], ())
    assert amp.last_overflow().nonfinite_loss and amp.last_overflow().loss_scale == 65536.0
    assert "keeping loss scale at 65536.0: the loss itself is inf or NaN" in caplog.messages[0]


def test_the_second_optimizer_of_a_block_adds_its_parameters_to_one_report(caplog):
    first, second, scaler = Skips(), Skips(), LossScaler("dynamic")
    check = checked_block(scaler, overflow=True)
    with caplog.at_level(logging.INFO, logger="amp"):
        first.skipped([check], ("a",))
        second.skipped([check], ("b", "a"))
    assert amp.last_overflow().params == ("a", "b")


def test_a_skip_the_device_took_is_reported_once_its_copy_is_read():
    skips, scaler = Skips(), LossScaler("dynamic")
    clean, overflowed = checked_block(scaler, False), checked_block(scaler, True)
    skips.stepped([clean, overflowed], known=False)
    assert skips.waiting == [clean, overflowed] and amp.last_overflow() is None
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0, float("inf")])
    skips.poll([param], lambda p: "w")
    assert skips.waiting == [] and amp.last_overflow().params == ("w",)


def test_a_clean_step_the_host_knew_reports_nothing():
    skips, scaler = Skips(), LossScaler("dynamic")
    skips.stepped([checked_block(scaler, False)], known=True)
    assert amp.last_overflow() is None and not amp_state.origin_watch.armed
