"""A GAN on handwritten digits: two models, two optimizers, three losses with their own scalers.

The discriminator's loss on real and on generated images and the generator's loss each get a
loss scaler (`num_losses=3`, `loss_id=0/1/2`), as in apex's DCGAN example. The data is scikit-
learn's 8x8 digits (shipped with it). At the end the script prints the losses, the loss scales
and how well the discriminator still tells real from generated images.

    python examples/gan.py                                  # O1, float16, CPU
    python examples/gan.py --opt-level O2 --device cuda --steps 2000
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import device_argument, dtype_argument, opt_level_argument, progress  # noqa: E402
from common import parser as example_parser  # noqa: E402
from demo import load_digits  # noqa: E402

import amp  # noqa: E402

NOISE = 16


def make_models(device):
    torch.manual_seed(0)
    generator = torch.nn.Sequential(
        torch.nn.Linear(NOISE, 128),
        torch.nn.BatchNorm1d(128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.Sigmoid(),
    ).to(device)
    discriminator = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.LeakyReLU(0.2),
        torch.nn.Linear(128, 1),
    ).to(device)
    return generator, discriminator


def train(opt_level="O1", dtype="float16", device="cpu", steps=400, batch=64, show_progress=True):
    images = load_digits(device)[0]
    generator, discriminator = make_models(device)
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4)
    optimizer_d = torch.optim.Adam(
        discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4
    )
    [generator, discriminator], [optimizer_g, optimizer_d] = amp.initialize(
        [generator, discriminator],
        [optimizer_g, optimizer_d],
        opt_level=opt_level,
        dtype=getattr(torch, dtype),
        num_losses=3,
        verbosity=0,
    )
    sampler = torch.Generator().manual_seed(1)
    history = {"discriminator": [], "generator": []}
    try:
        for _ in progress(range(steps), desc=f"GAN {opt_level}") if show_progress else range(steps):
            real = images[torch.randint(0, len(images), (batch,), generator=sampler).to(device)]
            noise = torch.randn(batch, NOISE, generator=sampler).to(device)
            ones = torch.ones(batch, 1, device=device)
            zeros = torch.zeros(batch, 1, device=device)

            # Discriminator: real images should score 1, generated ones 0; one loss scaler each.
            optimizer_d.zero_grad()
            loss_real = F.binary_cross_entropy_with_logits(discriminator(real), ones)
            with amp.scale_loss(loss_real, optimizer_d, loss_id=0) as scaled:
                scaled.backward()
            fake = generator(noise)
            loss_fake = F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros)
            with amp.scale_loss(loss_fake, optimizer_d, loss_id=1) as scaled:
                scaled.backward()
            optimizer_d.step()

            # Generator: make the discriminator score generated images 1.
            optimizer_g.zero_grad()
            loss_g = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
            with amp.scale_loss(loss_g, optimizer_g, loss_id=2) as scaled:
                scaled.backward()
            optimizer_g.step()
            history["discriminator"].append(loss_real.item() + loss_fake.item())
            history["generator"].append(loss_g.item())
        generator.eval()
        with torch.no_grad():
            real = images[:256]
            fake = generator(torch.randn(256, NOISE, generator=sampler).to(device))
            scores = torch.sigmoid(discriminator(torch.cat([real, fake])).float()).flatten()
            accuracy = (
                (scores[:256] > 0.5).float().mean() + (scores[256:] <= 0.5).float().mean()
            ).item() / 2
        scales = [entry["loss_scale"] for entry in amp.state_dict().values()]
    finally:
        amp.deinitialize()
    tail = 50
    return {
        "discriminator loss": sum(history["discriminator"][-tail:]) / tail,
        "generator loss": sum(history["generator"][-tail:]) / tail,
        "discriminator accuracy": accuracy,
        "loss scales": scales,
    }


def main(argv=None):
    parser = example_parser(__doc__)
    device_argument(parser)
    opt_level_argument(parser, "O1")
    dtype_argument(parser)
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    args = parser.parse_args(argv)
    result = train(args.opt_level, args.dtype, args.device, args.steps)
    for key, value in result.items():
        print(f"{key}: {value}")
    return result


if __name__ == "__main__":
    main()
