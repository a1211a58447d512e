"""torch.compile traces the FP8 path into one graph, where the casts fuse (and the speed is)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import amp
from helpers import subprocess_env


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@pytest.mark.slow
def test_o2_float8_step_compiles_into_one_graph_as_eager_computes_it():
    """One graph, no break, no recompile over steps; and with inductor rounding intermediates as
    eager does (`emulate_precision_casts`; by default a fused kernel keeps an FP32 value that
    eager rounds to bfloat16 before taking its amax), the compiled step's output and FP8
    gradients are eager's bit for bit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 8, 32)
    amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, float8="tensorwise")
    try:
        # The call, not the module: torch.compile(model) would compile O2's forward hooks as
        # frames of their own (with or without float8); here they are inlined into the graph.
        compiled = torch.compile(lambda inputs: model(inputs), fullgraph=True)  # breaks raise

        def grads(run):
            optimizer.zero_grad()
            out = run(x)
            out.square().mean().backward()
            return [out] + [p.grad.clone() for p in model.parameters()]

        with torch._inductor.config.patch(emulate_precision_casts=True):
            for _ in range(2):
                grads(compiled)
                optimizer.step()
            got = grads(compiled)
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        with amp.trace() as trace:
            want = grads(model)  # eager, the same weights
        assert [r.ran_in for r in trace.records if r.op.endswith("linear")] == [
            torch.float8_e4m3fn
        ] * 2
    finally:
        amp.deinitialize()
        torch._dynamo.reset()
    assert got[0].dtype is torch.float32  # O2's output cast
    # The output and the FP8 layers' gradients bit for bit; layer norm's bfloat16 backward is
    # inductor's own decomposition (it differs from eager's kernel with or without float8).
    names = ["output"] + [name for name, _ in model.named_parameters()]
    for name, a, b in zip(names, got, want):
        if name.startswith("norm."):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
        else:
            assert torch.equal(a, b), name


FRESH_PROCESS = """
import torch, amp
from torch import nn
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
amp.initialize(model, opt_level="{level}", dtype=torch.bfloat16, float8={float8!r}, verbosity=0)
out = torch.compile(lambda x: model(x), fullgraph=True)(torch.randn(16, 32))
print(out.dtype)
"""


@pytest.mark.slow
@pytest.mark.parametrize("level, float8", [("O1", None), ("O2", "tensorwise")])
def test_compiling_in_a_fresh_process_after_initialize_makes_one_graph(level, float8):
    """Dynamo builds its table of torch's functions at its first use: here after amp's patches
    are in place (amp primes it first; unprimed, every patched call broke the graph)."""
    code = FRESH_PROCESS.format(level=level, float8=float8)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == ("torch.bfloat16" if level == "O1" else "torch.float32")
