"""amp.autocast regions and O1 casting (amp/casting/autocast.py): what is cast, the weight cache,
regions and threads, RNNs, custom_fwd / custom_bwd."""

import gc
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import amp
from amp._state import amp_state
from helpers import DTYPES, HAS_CUDA
from helpers.models import loss_of, make_model
from helpers.profiling import CastCounter

LOW = pytest.mark.parametrize("dtype", DTYPES, ids=str)


# -- what is cast -------------------------------------------------------------------------------


@LOW
def test_listed_ops_run_in_their_policy_dtype(dtype):
    x = torch.randn(4, 4)
    with amp.autocast(dtype=dtype):
        assert torch.mm(x, x).dtype is dtype
        assert (x @ x).dtype is dtype
        assert x.to(dtype).softmax(-1).dtype is torch.float32
        assert torch.relu(x).dtype is torch.float32  # unlisted: runs as given
        assert torch.relu(x.to(dtype)).dtype is dtype


@LOW
def test_out_and_in_place_calls_run_untouched(dtype):
    x = torch.randn(4, 4)
    out = torch.empty(4, 4)
    with amp.autocast(dtype=dtype):
        torch.mm(x, x, out=out)
        assert out.dtype is torch.float32
        y = x.clone()
        y.add_(x.to(dtype))
        assert y.dtype is torch.float32


@LOW
def test_explicit_dtype_runs_as_asked(dtype):
    x = torch.randn(4, 4).to(dtype)
    with amp.autocast(dtype=dtype):
        assert torch.softmax(x, -1, dtype=dtype).dtype is dtype
        assert torch.softmax(x, -1, dtype).dtype is dtype  # positional
        assert x.sum(dtype=torch.float64).dtype is torch.float64
        assert x.sum().dtype is torch.float32


@LOW
def test_float64_int_and_bool_are_never_cast(dtype):
    d = torch.randn(3, 3, dtype=torch.float64)
    i = torch.arange(9).reshape(3, 3)
    with amp.autocast(dtype=dtype):
        assert torch.mm(d, d).dtype is torch.float64
        assert torch.mm(i, i).dtype is torch.int64
        assert torch.sum(i).dtype is torch.int64
        assert torch.exp(d).dtype is torch.float64
        with pytest.raises(RuntimeError):
            torch.mm(d, torch.randn(3, 3))  # the FP32 argument is cast, the float64 one is not


def test_promote_widest_and_mixed_low_types():
    h = torch.randn(3, dtype=torch.float16)
    b = torch.randn(3, dtype=torch.bfloat16)
    f = torch.randn(3)
    with amp.autocast():
        assert torch.atan2(h, f).dtype is torch.float32
        assert torch.atan2(h, h).dtype is torch.float16
        assert torch.atan2(h, b).dtype is torch.float32  # torch.amp raises here; amp widens
        assert torch.cat([h, h]).dtype is torch.float16
        assert torch.cat([h, f, h]).dtype is torch.float32
        assert torch.cat(tensors=[h, b]).dtype is torch.float32
        assert torch.stack([b, f]).dtype is torch.float32


@LOW
def test_banned_function_explains_what_to_use(dtype):
    p = torch.rand(4, dtype=dtype)
    with amp.autocast(dtype=dtype):
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            F.binary_cross_entropy(p, p)
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            torch.nn.BCELoss()(p, p)
        assert F.binary_cross_entropy(p.float(), p.float()).dtype is torch.float32
        with amp.disable_casts():
            F.binary_cross_entropy(p.float(), p.float())


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # a CUDA region, CPU only
@LOW
def test_device_type_limits_casting(dtype):
    x = torch.randn(4, 4)
    with amp.autocast(dtype=dtype, device_type="cuda"):
        assert torch.mm(x, x).dtype is torch.float32  # a CPU tensor is left alone
    with amp.autocast(dtype=dtype, device_type="cpu"):
        assert torch.mm(x, x).dtype is dtype


@pytest.mark.skipif(HAS_CUDA, reason="what a machine without CUDA does")
def test_a_cuda_region_without_cuda_warns_and_turns_itself_off_as_torchs():
    with pytest.warns(UserWarning, match="CUDA is not available") as torchs:
        torch.autocast("cuda", dtype=torch.float16)
    with pytest.warns(UserWarning, match=r"^CUDA is not available\. Disabling autocast\.$") as amps:
        region = amp.autocast("cuda", dtype=torch.float16)
    assert amps[0].category is torchs[0].category and amps[0].filename == __file__
    with region:
        # torch's readers say what they say in torch's disabled region
        assert not torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") is torch.float16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.autocast("cuda", enabled=False)  # torch says nothing for these either
        amp.autocast("cpu")
        amp.autocast()
    amp.deinitialize()


def test_containers_of_tensors_are_cast():
    weights = [torch.randn(4, 4) for _ in range(2)]
    with amp.autocast():
        assert torch.linalg.multi_dot([weights[0], weights[1], weights[0]]).dtype is torch.float16
        assert torch.einsum("ij,jk->ik", weights[0], weights[1]).dtype is torch.float16


# -- the weight cache -------------------------------------------------------------------------------


def test_weight_is_cast_once_per_region_and_per_dtype():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with CastCounter() as counter:
        with amp.autocast():
            for _ in range(3):
                linear(x)
        # input 3 times, weight and bias once each
        assert counter.casts == 3 + 2
        with amp.autocast():
            linear(x)
            with amp.autocast(dtype=torch.bfloat16):
                assert linear(x).dtype is torch.bfloat16  # never the float16 cast (torch's bug)
            assert linear(x).dtype is torch.float16
    assert len(amp_state.cast_cache) == 0  # cleared when the outermost region exits


def test_cache_disabled_casts_every_time():
    linear = torch.nn.Linear(4, 4)
    with CastCounter() as counter:
        with amp.autocast(cache_enabled=False):
            linear(torch.randn(2, 4))
            linear(torch.randn(2, 4))
    assert counter.casts == 6


def test_a_weight_stepped_by_any_optimizer_is_cast_anew():
    """torch's autocast caches the weight casts of the ops it decides (F.linear here) without
    looking at the weight again: amp empties the cache after every optimizer step, a torch.optim
    optimizer amp does not know included."""
    linear = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(linear.parameters(), lr=1.0)
    x = torch.randn(2, 4)
    with amp.autocast():
        first = linear(x)
        first.float().sum().backward()
        optimizer.step()
        second = linear(x)
        expected = F.linear(x.half(), linear.weight.half(), linear.bias.half())
    assert torch.equal(second, expected)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("update", ["in_place", "data_assignment"])
def test_amps_own_cache_never_serves_a_stale_weight(update):
    """The casts amp makes itself (here torch.einsum, which torch's CPU autocast leaves alone)
    are checked against the weight's version and storage at every use."""
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    with amp.autocast():
        first = torch.einsum("ij,kj->ik", x, weight)
        if update == "in_place":
            with torch.no_grad():
                weight.mul_(2)
        else:
            weight.data = weight.data * 2
        second = torch.einsum("ij,kj->ik", x, weight)
        expected = torch.einsum("ij,kj->ik", x.half(), weight.detach().half())
    assert torch.equal(second, expected)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("update", ["in_place", "data_assignment"])
def test_a_weight_written_by_hand_in_a_region_is_cast_anew_once_the_cache_is_emptied(update):
    """torch's cache (the ops torch decides) sees no in-place write: emptied by
    torch.clear_autocast_cache(), as under torch.autocast, or by the next region."""
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with amp.autocast():
        first = linear(x)
        if update == "in_place":
            with torch.no_grad():
                linear.weight.mul_(2)
        else:
            linear.weight.data = linear.weight.data * 2
        torch.clear_autocast_cache()
        second = linear(x)
    with amp.autocast():
        third = linear(x)
    expected = F.linear(x.half(), linear.weight.half(), linear.bias.half())
    assert torch.equal(second, expected) and torch.equal(third, expected)
    assert not torch.equal(first, second)


@LOW
def test_o1_steps_see_each_update_of_the_weights(dtype):
    """torch's cache holds O1's weight casts from one forward to the next: scale_loss and the
    step empty it, so that each step's forward casts the weights the last step wrote."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    reference = torch.nn.Linear(4, 4)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(8, 4)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=dtype, verbosity=0)
    try:
        outputs = []
        for _ in range(3):
            out = model(x)
            outputs.append(out.detach())
            with amp.scale_loss(out.float().square().mean(), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        amp.deinitialize()
    for out in outputs:
        expected = F.linear(x.to(dtype), reference.weight.to(dtype), reference.bias.to(dtype))
        assert torch.equal(out, expected)
        loss = F.linear(x.to(dtype), reference.weight.to(dtype), reference.bias.to(dtype))
        loss.float().square().mean().backward()
        with torch.no_grad():
            for param in reference.parameters():
                param -= 0.5 * param.grad
                param.grad = None


def test_cache_never_serves_the_cast_of_another_weight():
    # Weights made and dropped inside one region: each call gets the cast of its own weight.
    x = torch.randn(2, 4)
    with amp.autocast():
        for _ in range(20):
            weight = torch.nn.Parameter(torch.randn(4, 4))
            expected = F.linear(x.half(), weight.detach().half())
            assert torch.equal(F.linear(x, weight), expected)
            del weight


def test_cleared_cache_keeps_no_weight_alive():
    linear = torch.nn.Linear(4, 4)
    weight = weakref.ref(linear.weight)
    with amp.autocast():
        linear(torch.randn(2, 4))  # cached by torch's autocast: emptied when the region exits
    del linear
    gc.collect()
    assert weight() is None


def test_cache_made_under_no_grad_still_trains():
    linear = torch.nn.Linear(4, 4)
    with amp.autocast():
        with torch.no_grad():
            linear(torch.randn(2, 4))
        out = linear(torch.randn(2, 4))
    assert out.requires_grad
    out.float().sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.dtype is torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_frees_the_weight_casts_as_it_goes(dtype):
    """The forward's weight casts are not held through backward: autograd frees each one once
    its node has run, as under torch.autocast (lower peak memory)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", dtype=dtype, verbosity=0)
    try:
        saved = []

        def keep_a_weakref(tensor):
            if tensor.dtype is dtype:
                saved.append(weakref.ref(tensor))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep_a_weakref, lambda tensor: tensor):
            loss = loss_of(model, 0)
        # scale_loss empties the weight-cast caches (torch's holds the casts of this forward),
        # so autograd is left the only holder of each.
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
            gc.collect()
            assert len(saved) >= 2 and all(ref() is None for ref in saved)
    finally:
        amp.deinitialize()


def test_inference_mode_casts_are_not_cached():
    """A cast made in inference mode would fail backward if served later: it is not kept."""
    linear = torch.nn.Linear(4, 4)
    with amp.autocast():
        with torch.inference_mode():
            linear(torch.randn(2, 4))
        with CastCounter() as counter:
            out = linear(torch.randn(2, 4))
            linear(torch.randn(2, 4))
        assert counter.casts == 3 + 1  # weight and bias cast anew, then served in grad mode
    out.float().sum().backward()
    assert linear.weight.grad is not None


# -- regions ----------------------------------------------------------------------------------------


def test_nesting_restores_the_outer_region():
    x = torch.randn(3, 3)
    with amp.autocast(dtype=torch.bfloat16):
        with amp.autocast(enabled=False):
            assert torch.mm(x, x).dtype is torch.float32
            with amp.autocast(dtype=torch.float16):
                assert torch.mm(x, x).dtype is torch.float16
            assert torch.mm(x, x).dtype is torch.float32
        assert torch.mm(x, x).dtype is torch.bfloat16


def test_patches_stay_between_regions_and_deinitialize_restores_torch():
    original = (
        torch.softmax,
        torch.Tensor.__dict__.get("sum"),
        torch.cat,
        torch.autocast.__enter__,
        torch.autograd._engine_run_backward,
    )
    mm, linear = torch.mm, F.linear
    x = torch.randn(3, 3)
    with amp.autocast():
        assert torch.softmax is not original[0]
        assert torch.mm is mm and F.linear is linear  # torch's autocast casts them as amp would
    # Installed until amp.deinitialize(), so the next region is cheap; outside a region every
    # patched call runs its original untouched.
    assert torch.softmax is not original[0]
    assert torch.softmax(x.half(), -1).dtype is torch.float16
    assert torch.softmax(x, -1).equal(original[0](x, -1))
    amp.deinitialize()
    current = (
        torch.softmax,
        torch.Tensor.__dict__.get("sum"),
        torch.cat,
        torch.autocast.__enter__,
        torch.autograd._engine_run_backward,
    )
    assert all(now is then for now, then in zip(current, original))
    assert "sum" not in vars(torch.Tensor)


def test_exceptions_restore_state():
    x = torch.randn(3, 3)
    with pytest.raises(ZeroDivisionError):
        with amp.autocast():
            with amp.disable_casts():
                raise ZeroDivisionError("from inside both regions")
    assert torch.mm(x, x).dtype is torch.float32
    assert amp_state.torch_patches.users == 0
    assert not torch.is_autocast_enabled("cpu")


def test_decorator_form_and_validation():
    @amp.autocast(dtype=torch.bfloat16)
    def product(a):
        return a @ a

    assert product(torch.randn(2, 2)).dtype is torch.bfloat16
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        amp.autocast(dtype=torch.float32)
    with pytest.raises(RuntimeError, match="device_type"):  # torch's exception type
        amp.autocast(device_type="tpu")
    with pytest.raises(TypeError, match="callable"):
        amp.autocast()(3)


def test_regions_are_thread_local():
    x = torch.randn(3, 3)
    seen = {}

    def other_thread():
        seen["dtype"] = torch.mm(x, x).dtype

    with amp.autocast():
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert torch.mm(x, x).dtype is torch.float16
    assert seen["dtype"] is torch.float32  # a new thread starts outside any region


def test_o1_casts_in_its_thread_and_disable_casts_is_local():
    """O1 casts through torch's autocast state, which is per thread: in the thread that called
    initialize. A thread started under O1 starts with casting off, as under torch.autocast, and
    a region there casts."""
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        x = torch.randn(3, 3)
        seen = {}

        def other_thread():
            seen["outside"] = torch.mm(x, x).dtype, torch.is_autocast_enabled("cpu")
            with amp.autocast(dtype=torch.bfloat16):
                seen["region"] = torch.mm(x, x).dtype
            seen["after"] = torch.mm(x, x).dtype

        with amp.disable_casts():
            worker = threading.Thread(target=other_thread)
            worker.start()
            worker.join()
            assert torch.mm(x, x).dtype is torch.float32
        assert seen == {
            "outside": (torch.float32, False),
            "region": torch.bfloat16,
            "after": torch.float32,
        }
        assert torch.mm(x, x).dtype is torch.float16
    finally:
        amp.deinitialize()


def test_deinitialize_from_another_thread_warns_and_leaves_the_o1_thread_alone():
    amp.initialize(torch.nn.Linear(3, 3), opt_level="O1", verbosity=0)
    caught = []

    def other_thread():
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            amp.deinitialize()
        caught.extend(found)

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    try:
        assert any("another thread than amp.initialize" in str(w.message) for w in caught)
        assert torch.is_autocast_enabled("cpu")  # this thread's state is only this thread's
    finally:  # what amp could not reach from the other thread
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        torch.set_autocast_dtype("cuda", torch.float16)


def test_deinitialize_inside_a_region_of_the_o1_thread_ends_o1_when_the_region_exits():
    x = torch.randn(3, 3)
    amp.initialize(torch.nn.Linear(3, 3), opt_level="O1", verbosity=0)
    with amp.autocast(dtype=torch.bfloat16):
        amp.deinitialize()
        assert torch.mm(x, x).dtype is torch.bfloat16  # the region goes on
    assert torch.mm(x, x).dtype is torch.float32
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
    assert torch.get_autocast_dtype("cuda") is torch.float16


def test_optimizer_step_runs_with_casts_disabled():
    model = torch.nn.Linear(3, 3)
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype)
            return super().step(closure)

    optimizer = Spy(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    try:
        with amp.scale_loss(model(torch.randn(2, 3)).float().mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    finally:
        amp.deinitialize()
    assert seen == [torch.float32]


# -- RNNs ---------------------------------------------------------------------------------------------


@LOW
@pytest.mark.parametrize(
    "module",
    [
        lambda: torch.nn.LSTM(4, 3),
        lambda: torch.nn.GRU(4, 3, num_layers=2),
        lambda: torch.nn.RNN(4, 3, bidirectional=True),
        lambda: torch.nn.RNN(4, 3, nonlinearity="relu"),
    ],
    ids=["lstm", "gru-2-layers", "rnn-bidirectional", "rnn-relu"],
)
def test_rnns_run_in_low_precision(module, dtype):
    rnn = module()
    x = torch.randn(5, 2, 4, requires_grad=True)
    with amp.autocast(dtype=dtype):
        output, _ = rnn(x)
    assert output.dtype is dtype
    output.float().sum().backward()
    assert x.grad.dtype is torch.float32
    assert all(p.grad.dtype is torch.float32 for p in rnn.parameters())


@LOW
@pytest.mark.parametrize("cell", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell])
def test_rnn_cells_run_in_low_precision(cell, dtype):
    rnn = cell(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with amp.autocast(dtype=dtype):
        state = None
        for _ in range(3):
            state = rnn(x, state)
        output = state[0] if isinstance(state, tuple) else state
    assert output.dtype is dtype
    output.float().sum().backward()
    assert x.grad.dtype is torch.float32


def test_packed_sequences():
    rnn = torch.nn.LSTM(4, 3, num_layers=2)
    x = torch.randn(6, 3, 4, requires_grad=True)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 4, 3]))
    with amp.autocast():
        output, _ = rnn(packed)
    assert output.data.dtype is torch.float16
    output.data.float().sum().backward()
    assert x.grad.dtype is torch.float32


# -- custom_fwd / custom_bwd ---------------------------------------------------------------------------


def _function(cast_inputs, backward_device=None):
    class Square(torch.autograd.Function):
        @staticmethod
        @amp.custom_fwd(cast_inputs=cast_inputs)
        def forward(ctx, a, container):
            ctx.save_for_backward(a)
            ctx.forward_dtype = torch.mm(a, a).dtype
            return a * container["b"]

        @staticmethod
        @amp.custom_bwd(device_type=backward_device)
        def backward(ctx, grad):
            (a,) = ctx.saved_tensors
            ctx_dtype = torch.mm(a, a).dtype
            Square.backward_dtypes.append(ctx_dtype)
            return grad * 2, None

    Square.backward_dtypes = []
    return Square


def test_custom_fwd_cast_inputs_turns_casting_off_inside():
    function = _function(torch.float32)
    a = torch.randn(3, 3, dtype=torch.float16, requires_grad=True)
    with amp.autocast():
        out = function.apply(a, {"b": torch.ones(3, 3, dtype=torch.float16)})
    assert out.dtype is torch.float32
    out.sum().backward()
    assert function.backward_dtypes == [torch.float32]
    assert a.grad.dtype is torch.float16


def test_custom_fwd_without_cast_inputs_keeps_the_region_in_backward():
    function = _function(None)
    a = torch.randn(3, 3, requires_grad=True)
    with amp.autocast(dtype=torch.bfloat16):
        out = function.apply(a, {"b": torch.ones(3, 3)})
    out.sum().backward()  # outside the region: backward still runs under its policy
    assert function.backward_dtypes == [torch.bfloat16]


def test_custom_fwd_outside_a_region_does_nothing():
    function = _function(torch.float32)
    a = torch.randn(3, 3, dtype=torch.float16, requires_grad=True)
    assert function.apply(a, {"b": torch.ones(3, 3, dtype=torch.float16)}).dtype is torch.float16


@pytest.mark.parametrize(
    ("device_type", "expected"), [("cpu", torch.bfloat16), ("cuda", torch.float32)]
)
def test_custom_bwd_device_type_restores_that_device_only(device_type, expected):
    # as torch.amp.custom_bwd(device_type=...): the forward's casting on that device; the other
    # device keeps what is in force where backward runs (here nothing)
    function = _function(None, backward_device=device_type)
    a = torch.randn(3, 3, requires_grad=True)
    with amp.autocast(dtype=torch.bfloat16):
        out = function.apply(a, {"b": torch.ones(3, 3)})
    out.sum().backward()
    assert function.backward_dtypes == [expected]


@pytest.mark.parametrize("decorator", [amp.custom_fwd, amp.custom_bwd])
def test_custom_decorators_refuse_an_unknown_device_type(decorator):
    with pytest.raises(ValueError, match="device_type='mps'.*must be one of"):
        decorator(device_type="mps")
