"""The small models, batches and losses the tests train, one definition each."""

import collections
import dataclasses

import torch


def make_model(seed=0, inputs=4, hidden=8, outputs=2, batch_norm=False):
    """Linear(inputs, hidden), [BatchNorm1d(hidden)], ReLU, Linear(hidden, outputs), from `seed`."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(inputs, hidden)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(hidden))
    layers += [torch.nn.ReLU(), torch.nn.Linear(hidden, outputs)]
    return torch.nn.Sequential(*layers)


def make_stack(layers, width=4, activation=torch.nn.ReLU, seed=0):
    """`layers` times Linear(width, width) and `activation`, from `seed`."""
    torch.manual_seed(seed)
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), activation()]
    return torch.nn.Sequential(*modules)


def batch(step, seed=100, size=16, inputs=4, outputs=2):
    """(x, y) of batch `step`: drawn from a generator seeded with seed + step."""
    generator = torch.Generator().manual_seed(seed + step)
    x = torch.randn(size, inputs, generator=generator)
    if outputs is None:
        return x, None
    return x, torch.randn(size, outputs, generator=generator)


def loss_of(model, step=0, seed=100, size=16, inputs=4, outputs=2, offset=None):
    """The mean squared error of `model` (plus `offset`) on batch(step); with outputs=None, the
    mean square of the output."""
    x, y = batch(step, seed, size, inputs, outputs)
    out = model(x).float()
    if y is None:
        return out.square().mean()
    if offset is not None:
        out = out + offset.float()
    return ((out - y) ** 2).mean()


def inject(param, kind="inf"):
    """Write inf (or NaN) into the first element of `param`'s gradient."""
    param.grad.view(-1)[0] = float("inf") if kind == "inf" else float("nan")


# -- nested batch types, as models take them --------------------------------------------------------

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    image: torch.Tensor


class Movable:
    """A custom batch type with a .to() method."""

    def __init__(self, tensor):
        self.tensor = tensor

    def to(self, dtype):
        return Movable(self.tensor.to(dtype))


# -- a model whose body overflows float16 -----------------------------------------------------------


class KeptNet(torch.nn.Module):
    """embed, body (Linear + GELU), norm, head: the body is the part to keep in FP32."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.norm(self.body(self.embed(x))))


def overflowing_net():
    """(KeptNet, inputs, class targets) with the body's FP32 output near 1e5, beyond float16."""
    torch.manual_seed(0)
    model = KeptNet()
    with torch.no_grad():
        model.body[0].weight.mul_(1e5)
    return model, torch.randn(32, 8), torch.randint(0, 4, (32,))
