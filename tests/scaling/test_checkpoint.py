"""amp.state_dict / amp.load_state_dict (amp/scaling/checkpoint.py): apex's format, plain values
that torch.load(weights_only=True) reads, and loss-scaler checkpoints checked whole before
anything is written (amp/scaling/values.py says what a value may be)."""

import pytest
import torch

import amp
from helpers.models import make_model
from helpers.o2 import static_o2
from helpers.state import assert_same, everything, scaled_step, step_cleanly


def _linear_at_o1(**kwargs):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level="O1", verbosity=0, **kwargs)


# -- amp.load_state_dict: loss-scaler checkpoints are checked whole before anything is written ----


@pytest.mark.parametrize("first_step", [False, True])
def test_a_scale_that_underflows_float32_is_refused_and_changes_nothing(trained, first_step):
    model, optimizer = trained("O1")
    if first_step:
        step_cleanly(model, optimizer)
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match="does not fit a float32 loss scale"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1e-46, "unskipped": 0}})
    assert_same(before, everything(model, optimizer))
    step_cleanly(model, optimizer, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize(
    "bad", [{"loss_scale": 8.0, "unskipped": 2**31}, {"loss_scale": 1e39, "unskipped": 0}]
)
def test_a_load_is_all_or_nothing(trained, first_step, bad):
    model, optimizer = trained("O1", num_losses=2)
    if first_step:
        step_cleanly(model, optimizer)
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match="does not fit"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 3}, "loss_scaler1": bad}
        )
    assert_same(before, everything(model, optimizer))
    step_cleanly(model, optimizer, 1)  # and scale_loss still works


def test_two_keys_for_one_scaler_are_refused():
    static_o2()
    before = amp.state_dict()
    with pytest.raises(RuntimeError, match="'loss_scaler0' and 'loss_scaler00' both name"):
        amp.load_state_dict(
            {
                "loss_scaler0": {"loss_scale": 128.0, "unskipped": 0},
                "loss_scaler00": {"loss_scale": 128.0, "unskipped": 3},
            }
        )
    assert amp.state_dict() == before
    amp.deinitialize()


@pytest.mark.parametrize(
    "scale", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"]
)
def test_an_int_loss_scale_too_large_for_a_float_gets_amps_error(scale):
    model, optimizer = amp.initialize(
        torch.nn.Linear(2, 2),
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        opt_level="O1",
        verbosity=0,
    )
    before = amp.state_dict()
    with pytest.raises(ValueError, match="int of .* bits"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}})
    with pytest.raises(ValueError, match="int of .* bits"):
        amp._amp_state.loss_scalers[0]._loss_scale = scale
    assert amp.state_dict() == before
    amp.deinitialize()


def test_a_multi_element_tensor_as_loss_scale_is_refused(trained):
    model, optimizer = trained("O1")
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match=r"tensor of shape \(2,\); expected a number"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": torch.tensor([2.0, 4.0]), "unskipped": 0}}
        )
    assert_same(before, everything(model, optimizer))


def test_a_numpy_scalar_loads_as_a_loss_scale():
    import numpy as np

    model = torch.nn.Linear(4, 2)
    amp.initialize(model, opt_level="O1", verbosity=0)
    try:
        amp.load_state_dict({"loss_scaler0": {"loss_scale": np.float32(1024), "unskipped": 0}})
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1024.0
    finally:
        amp.deinitialize()


def test_a_static_checkpoint_starts_a_dynamic_scaler_at_its_scale(caplog):
    source, optimizer = static_o2()  # loss_scale=128.0: static
    scaled_step(source, optimizer)
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["dynamic"] is False
    amp.deinitialize()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, optimizer = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", loss_scale="dynamic"
    )
    with caplog.at_level("INFO", logger="amp"):
        amp.load_state_dict(saved)
    assert "comes from a static loss scale" in caplog.text
    assert amp.state_dict()["loss_scaler0"] == {
        "loss_scale": 128.0,
        "unskipped": 0,
        "dynamic": True,
    }
    scaled_step(model, optimizer, overflow=True)  # an overflow: dynamic backs off
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 64.0
    scaled_step(model, optimizer)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1
    amp.deinitialize()


def test_a_static_checkpoint_outside_the_dynamic_bounds_is_refused():
    _linear_at_o1(max_loss_scale=1024.0)
    before = amp.state_dict()
    with pytest.raises(ValueError, match="outside min_loss_scale=None and max_loss_scale=1024.0"):
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 4096.0, "unskipped": 0, "dynamic": False}}
        )
    assert amp.state_dict() == before
    amp.deinitialize()


def test_a_dynamic_checkpoint_into_a_static_scale_set_at_o1_is_refused():
    _linear_at_o1(loss_scale=128.0)
    entry = {"loss_scale": 128.0, "unskipped": 0, "dynamic": True}
    with pytest.raises(ValueError, match="from a dynamic loss scaler, but this run's is static"):
        amp.load_state_dict({"loss_scaler0": entry})
    amp.deinitialize()


@pytest.mark.parametrize("kind", [False, None])
def test_a_refused_static_scale_says_where_the_checkpoint_comes_from(kind):
    _linear_at_o1(loss_scale=128.0)
    entry = {"loss_scale": 64.0, "unskipped": 0}
    if kind is not None:
        entry["dynamic"] = kind  # amp's static checkpoint; without the key, apex's (kind unknown)
    with pytest.raises(ValueError, match="static loss scale 128.0") as refused:
        amp.load_state_dict({"loss_scaler0": entry})
    amp.deinitialize()
    message = str(refused.value)
    assert "dynamic run" not in message
    if kind is False:
        assert "comes from a static run with another scale" in message
    else:
        assert "does not say whether its scaler was static or dynamic" in message


def test_a_dynamic_checkpoint_into_o3s_static_scaler_is_refused_and_changes_nothing(trained):
    source, source_optimizer = trained("O1")
    saved = amp.state_dict()
    amp.deinitialize()
    model, optimizer = trained("O3")
    before = everything(model, optimizer)
    with pytest.raises(ValueError, match="from a dynamic loss scaler.*loss_scale='dynamic'"):
        amp.load_state_dict(saved)
    unmarked = {"loss_scaler0": {k: v for k, v in saved["loss_scaler0"].items() if k != "dynamic"}}
    with pytest.raises(ValueError, match="static loss scale 1.0.*loss_scale='dynamic'"):
        amp.load_state_dict(unmarked)  # an apex checkpoint has no kind: the scale still tells
    assert_same(before, everything(model, optimizer))
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})  # its own: fine
    step_cleanly(model, optimizer)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_apex_static_count_into_a_dynamic_run_starts_counting_from_zero():
    _linear_at_o1()
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 50000}})  # apex O3
    expected = {"loss_scale": 128.0, "unskipped": 0, "dynamic": True}
    assert amp.state_dict()["loss_scaler0"] == expected
    with pytest.raises(ValueError, match="growth interval"):  # amp's own dynamic dict: damaged
        amp.load_state_dict(
            {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 5000, "dynamic": True}}
        )
    amp.deinitialize()


# -- amp.state_dict / amp.load_state_dict ---------------------------------------------------------


def make_pair():
    model = make_model(batch_norm=True, outputs=3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_state_dict_format_and_weights_only_load(tmp_path):
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, num_losses=2, verbosity=0)
    state = amp.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1"]
    assert state["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0, "dynamic": True}
    path = tmp_path / "amp.pt"
    torch.save(state, path)
    assert torch.load(path, weights_only=True) == state
    amp.deinitialize()


def test_load_state_dict_round_trip_and_apex_dicts():
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, num_losses=2, verbosity=0)
    apex_saved = {
        "loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17},
        "loss_scaler1": {"loss_scale": 8.0, "unskipped": 3},
    }
    amp.load_state_dict(apex_saved)  # apex's entries carry no kind: accepted
    assert amp.state_dict() == {key: dict(entry, dynamic=True) for key, entry in apex_saved.items()}
    amp.deinitialize()


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (
            {"scaler": {"loss_scale": 1.0, "unskipped": 0}},
            RuntimeError,
            'Unexpected key\\(s\\) in state_dict: "scaler"',
        ),
        ({"loss_scaler0": {"loss_scale": -1.0, "unskipped": 0}}, ValueError, "finite positive"),
        (
            {"loss_scaler0": {"loss_scale": float("nan"), "unskipped": 0}},
            ValueError,
            "finite positive",
        ),
        ({"loss_scaler0": {"loss_scale": 2.0}}, ValueError, "lacks"),
        ({"loss_scaler0": {"loss_scale": 2.0, "unskipped": -3}}, ValueError, "non-negative"),
        ({"loss_scaler0": 4.0}, TypeError, "must be a dict"),
        ([1, 2], TypeError, "expects the dict"),
    ],
)
def test_malformed_state_dict_raises_and_loads_nothing(bad, error, match):
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, num_losses=1, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 5}})
    good_and_bad = dict(bad) if isinstance(bad, dict) else bad
    with pytest.raises(error, match=match):
        amp.load_state_dict(good_and_bad)
    assert amp.state_dict()["loss_scaler0"] == {
        "loss_scale": 512.0,
        "unskipped": 5,
        "dynamic": True,
    }
    amp.deinitialize()


def test_state_dict_with_more_entries_warns_and_skips():
    model, optimizer = make_pair()
    amp.initialize(model, optimizer, num_losses=1, verbosity=0)
    with pytest.warns(UserWarning) as warned:
        amp.load_state_dict(
            {
                "loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
                "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0},
            }
        )
    assert [str(w.message) for w in warned] == [
        "state_dict contains 2 entries, while 1 loss_scalers are used",
        "Skipping loss_scaler[1], since num_losses was set to 1",
    ]
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0
    amp.deinitialize()


def test_state_dict_needs_initialize():
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.state_dict()
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.load_state_dict({})
