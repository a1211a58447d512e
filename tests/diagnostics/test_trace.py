"""amp.trace (amp/diagnostics/trace.py): what ran in which precision, as records and a table;
amp's own arithmetic in a training step stays out of it."""

import pytest
import torch

import amp
from helpers import ROOT
from helpers.models import loss_of, make_model


def test_trace_records_ops_dtypes_and_prints_a_table():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with amp.trace() as outer:
        with amp.autocast(dtype=torch.bfloat16):
            with amp.trace() as inner:
                y = linear(x)
            y.softmax(-1)
            with amp.disable_casts():
                torch.mm(x, x.t())
    assert inner.ops() == ["torch.nn.functional.linear"]
    first = inner.records[0]
    assert first.input_dtypes == (torch.float32,) * 3
    assert first.ran_in is torch.bfloat16 and first.output_dtype is torch.bfloat16 and first.cast
    assert outer.ops() == ["torch.nn.functional.linear", "torch.Tensor.softmax", "torch.mm"]
    assert outer.records[1].ran_in is torch.float32
    assert outer.records[2].policy == "off" and not outer.records[2].cast
    table = str(outer)
    assert (
        "torch.Tensor.softmax" in table
        and "bfloat16" in table
        and "3 patched calls, 2 with casts" in table
    )


def test_trace_outside_regions_records_nothing():
    with amp.trace() as record:
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert len(record) == 0


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_trace_of_a_training_step_shows_only_the_models_ops(opt_level):
    """amp's own arithmetic (scaling, unscaling, the scale update, master copies) never goes
    through its patches, so a user's trace of a step lists the model's ops and nothing else."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    try:
        for step in range(2):
            with amp.trace() as trace:
                optimizer.zero_grad()
                with amp.scale_loss(loss_of(model, step), optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
            assert trace.ops() == (
                ["torch.nn.functional.linear"] * 2 + ["torch.Tensor.__pow__"]
                if opt_level == "O1"
                else []
            )
    finally:
        amp.deinitialize()


def test_the_docs_trace_example_prints_what_the_docs_show(capsys):
    page = (ROOT / "docs" / "diagnostics.md").read_text()
    section = page.split("## Seeing what runs in which precision", 1)[1]
    code, rest = section.split("```python\n", 1)[1].split("```\n", 1)
    shown = rest.split("```\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/diagnostics.md", "exec"), {})
    amp.deinitialize()
    assert capsys.readouterr().out == shown
