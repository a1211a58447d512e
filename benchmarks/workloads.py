"""The models and data the step benchmarks train, by name; each builds a fresh, seeded FP32 model.

transformer-w16-dN-s8     models.Encoder, width 16, 4 heads, vocab 256, N layers, batch 2 x 8
                          tokens: a host-bound step (the Python-calls workloads, N = 1, 4, 16)
transformer-w512-d4-sL    models.Encoder, 4 layers, width 512, 8 heads, vocab 1024, batch 8 x L
                          tokens (the memory workloads, L = 128 and 512; width 64 at CI sizes)
cnn                       models.ResNet at width 16, one bottleneck per stage, 10 classes,
                          batch 32 of 3x64x64 images (cnn-tiny: width 8, batch 8 of 32x32)
gpt2                      GPT-2 small (124M), batch 8 x 1024 tokens
resnet50                  ResNet-50, batch 64 of 3x224x224 images, 1000 classes
gpt2-tiny, resnet50-tiny  the same code at CI sizes (2 layers of width 32; width 8, 32x32)
"""

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from models import GPT2, Encoder, ResNet


def loss_fn(output, targets):
    """Cross entropy in FP32 over the last dimension (tokens or images)."""
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class Workload:
    name: str
    model: Callable[[], torch.nn.Module]  # a fresh FP32 model on the CPU, the same every call
    batch: Callable[..., tuple]  # (device, batch=None) -> (inputs, targets); None: full size
    unit: str  # "tokens" or "images": what a throughput counts
    per_batch: int  # tokens or images in a full batch

    def build(self, device):
        torch.manual_seed(0)
        return self.model().to(device)


def _tokens(vocab, length, batch, device, size=None):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (size or batch, length + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _images(classes, side, batch, device, size=None):
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(size or batch, 3, side, side, generator=generator)
    labels = torch.randint(0, classes, (size or batch,), generator=generator)
    return images.to(device), labels.to(device)


def transformer(width, layers, length, batch, vocab, heads):
    return Workload(
        f"transformer-w{width}-d{layers}-s{length}",
        functools.partial(Encoder, vocab, width, heads, length, layers),
        functools.partial(_tokens, vocab, length, batch),
        "tokens",
        batch * length,
    )


def cnn(width, blocks, side, batch, classes, name):
    return Workload(
        name,
        functools.partial(ResNet, classes, width, blocks),
        functools.partial(_images, classes, side, batch),
        "images",
        batch,
    )


def gpt2(vocab, length, width, layers, heads, batch, name):
    return Workload(
        name,
        functools.partial(GPT2, vocab, length, width, layers, heads),
        functools.partial(_tokens, vocab, length, batch),
        "tokens",
        batch * length,
    )


def host_bound_transformer(depth):
    return transformer(width=16, layers=depth, length=8, batch=2, vocab=256, heads=4)


def memory_transformer(length, width=512):
    return transformer(width=width, layers=4, length=length, batch=8, vocab=1024, heads=8)


SMALL_CNN = cnn(16, (1, 1, 1, 1), side=64, batch=32, classes=10, name="cnn")
TINY_CNN = cnn(8, (1, 1, 1, 1), side=32, batch=8, classes=10, name="cnn-tiny")
END_TO_END = {
    "gpt2": gpt2(50257, 1024, 768, 12, 12, batch=8, name="gpt2"),
    "resnet50": cnn(64, (3, 4, 6, 3), side=224, batch=64, classes=1000, name="resnet50"),
    "gpt2-tiny": gpt2(128, 32, 32, 2, 2, batch=2, name="gpt2-tiny"),
    "resnet50-tiny": cnn(8, (1, 1, 1, 1), side=32, batch=4, classes=10, name="resnet50-tiny"),
}
