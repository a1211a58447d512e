"""The benchmarks' models, written here from their published architectures (no torchvision or
transformers dependency), each with the sizes of the paper as defaults and small sizes for CPU.

  Encoder   pre-norm torch.nn.TransformerEncoder language model (the step benchmarks' model)
  GPT2      GPT-2 (Radford et al. 2019): GPT2() is GPT-2 small, 124M parameters, context 1024
  ResNet    ResNet-50 v1.5 (He et al. 2016, stride on the 3x3 conv as in torchvision): ResNet()
            is ResNet-50, 25.6M parameters; ResNet(width=16, blocks=(1, 1, 1, 1)) a small CNN
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    """Token and learned position embeddings, `layers` pre-norm encoder layers under a causal
    mask, a linear head. Sequences up to `length` tokens."""

    def __init__(self, vocab, width, heads, length, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(length), persistent=False
        )

    def forward(self, tokens):
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        mask = self.mask[:length, :length]
        return self.head(self.blocks(x, mask=mask, is_causal=True))


class _Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.c_attn(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class _Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2: learned positions, pre-norm blocks with GELU (tanh), a final LayerNorm, the head
    tied to the token embedding; GPT-2's initialisation (N(0, 0.02), residual projections scaled
    by 1/sqrt(2 * layers)). No dropout: the benchmarks compare deterministic steps."""

    def __init__(self, vocab=50257, context=1024, width=768, layers=12, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * layers))
            elif parameter.dim() == 2:
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inputs, width, stride):
        super().__init__()
        outputs = width * self.expansion
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, outputs, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(outputs)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    """A 7x7/2 stem and 3x3/2 max-pool, four stages of bottleneck blocks (widths `width` x 1, 2,
    4, 8; the first block of stages 2-4 strides by 2), global average pooling, a linear head.
    Kaiming (fan-out) convolutions, BatchNorm at weight 1 and bias 0."""

    def __init__(self, classes=1000, width=64, blocks=(3, 4, 6, 3)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, inputs = [], width
        for index, count in enumerate(blocks):
            stage_width = width * 2**index
            stride = 1 if index == 0 else 2
            stage = []
            for block in range(count):
                stage.append(_Bottleneck(inputs, stage_width, stride if block == 0 else 1))
                inputs = stage_width * _Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inputs, classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(images))), 3, stride=2, padding=1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.stages(x), 1), 1))
