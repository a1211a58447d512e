"""O2's deferred master gradients (amp/weights/deferral.py): kept low precision and scaled until the
step; made FP32 (unscaled as scale_loss's exit would have) when anything touches a master's
`.grad`; the masters a plain Parameter again when they go. The torch backend runs the check on
the CPU, as the CuPy kernels do on a GPU."""

import copy

import torch

from amp.weights.deferral import Deferral


def kept_gradients(inf_in=None):
    masters = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    models = [torch.nn.Parameter(m.detach().to(torch.bfloat16)) for m in masters]
    grads = [torch.tensor([4.0, 8.0, 16.0]), torch.full((2, 2), 2.0)]
    grads = [g.to(torch.bfloat16) for g in grads]
    if inf_in is not None:
        grads[inf_in].view(-1)[0] = float("inf")
    deferral, found = Deferral(), torch.zeros(())
    deferral.defer(models, masters, grads, torch.tensor(0.25), found)
    return deferral, models, masters, found


def test_defer_checks_the_gradients_and_keeps_them_without_making_fp32_ones():
    deferral, models, masters, found = kept_gradients(inf_in=1)
    assert found.item() == 1.0 and deferral.kept.nonfinite_models() == [models[1]]
    assert all(type(m) is not torch.nn.Parameter and isinstance(m, torch.nn.Parameter) for m in masters)
    assert all(torch.Tensor.grad.__get__(m) is None for m in masters)  # none made yet


def test_a_read_of_a_masters_grad_makes_them_all_fp32_unscaled():
    deferral, _, masters, found = kept_gradients()
    assert found.item() == 0.0
    grad = masters[0].grad  # through the deferring class
    assert deferral.kept is None and grad.dtype is torch.float32
    assert torch.equal(grad, torch.tensor([1.0, 2.0, 4.0]))
    assert torch.equal(masters[1].grad, torch.full((2, 2), 0.5))
    assert all(type(m) is torch.nn.Parameter for m in masters)


def test_take_hands_them_over_and_the_masters_are_plain_again():
    deferral, _, masters, _ = kept_gradients()
    kept = deferral.take()
    assert kept.grads_of(masters[::-1])[0].shape == (2, 2) and deferral.kept is None
    assert all(type(m) is torch.nn.Parameter and m.grad is None for m in masters)


def test_a_copy_of_a_master_made_meanwhile_is_a_plain_parameter():
    deferral, _, masters, _ = kept_gradients()
    copied = copy.deepcopy(masters[0])
    assert type(copied) is torch.nn.Parameter and deferral.kept is not None
