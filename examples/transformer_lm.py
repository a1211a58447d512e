"""A small character-level transformer language model, trained with amp on the Python reference.

The text (examples/data/python_reference.txt, 300 kB) ships with the repository. The model is a
pre-norm decoder-only transformer; the script reports the training loss as it goes and the
held-out loss (nats per character) at the end.

    python examples/transformer_lm.py                               # O1, bfloat16, CPU
    python examples/transformer_lm.py --opt-level O2 --dtype float16 --device cuda --steps 2000
"""

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument, dtype_argument, opt_level_argument, progress  # noqa: E402
from common import parser as example_parser  # noqa: E402

import amp  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "data", "python_reference.txt")


class CharTransformer(torch.nn.Module):
    def __init__(self, vocab, width, heads, layers, length):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(length, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            width,
            heads,
            4 * width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
            activation="gelu",
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(length), persistent=False
        )

    def forward(self, tokens):
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        x = self.blocks(x, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))


def load_text(device):
    with open(TEXT) as handle:
        text = handle.read()
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    data = torch.tensor([index[char] for char in text], dtype=torch.int64, device=device)
    split = int(0.9 * len(data))
    return vocabulary, data[:split], data[split:]


def batches(data, batch, length, generator):
    while True:
        starts = torch.randint(0, len(data) - length - 1, (batch,), generator=generator)
        rows = torch.stack([data[s : s + length + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


def evaluate(model, data, length, batch=32):
    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, min(len(data) - length - 1, 64 * length), length):
            rows = data[start : start + length + 1].unsqueeze(0)
            logits = model(rows[:, :-1])
            losses.append(
                F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()).item()
            )
    model.train()
    return sum(losses) / len(losses)


def train(
    opt_level="O1",
    dtype="bfloat16",
    device="cpu",
    steps=300,
    batch=16,
    length=64,
    width=128,
    heads=4,
    layers=2,
    lr=3e-3,
    log_every=50,
    show_progress=True,
):
    vocabulary, train_data, held_out = load_text(device)
    torch.manual_seed(0)
    model = CharTransformer(len(vocabulary), width, heads, layers, length).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, eps=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, dtype=getattr(torch, dtype), verbosity=0
    )
    generator = torch.Generator().manual_seed(1)
    history = []
    try:
        stream = batches(train_data, batch, length, generator)
        for step in (
            progress(range(steps), desc=f"{opt_level} {dtype}") if show_progress else range(steps)
        ):
            tokens, targets = next(stream)
            logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            history.append(loss.item())
            if log_every and (step + 1) % log_every == 0:
                print(
                    f"step {step + 1:5d}  loss {sum(history[-log_every:]) / log_every:.3f}",
                    flush=True,
                )
        held_out_loss = evaluate(model, held_out, length)
    finally:
        amp.deinitialize()
    return {"train loss": sum(history[-20:]) / len(history[-20:]), "held-out loss": held_out_loss}


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    opt_level_argument(parser, "O1")
    dtype_argument(parser, "bfloat16")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch")
    parser.add_argument("--length", type=int, default=64, help="characters per sequence")
    parser.add_argument("--width", type=int, default=128, help="the model's width")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    args = parser.parse_args(argv)
    result = train(
        args.opt_level,
        args.dtype,
        args.device,
        args.steps,
        args.batch,
        args.length,
        args.width,
        layers=args.layers,
    )
    print(
        f"held-out loss {result['held-out loss']:.3f} nats/char "
        f"(perplexity {math.exp(result['held-out loss']):.2f}); final train loss {result['train loss']:.3f}"
    )
    return result


if __name__ == "__main__":
    main()
