"""The benchmarks (benchmarks/) run, and what they count is right (timing is for benchmarks/,
never asserted). Each script runs at its smallest size in the default run; the whole suite
(run_all.py --quick --tiny, minutes on a loaded machine) is marked slow: `make test-all`."""

import subprocess
import sys

import pytest
import torch

from helpers import ROOT, fake_cupy
from helpers.cuda_emulation import build

sys.path.insert(0, str(ROOT / "benchmarks"))
import end_to_end  # noqa: E402
import module_walk  # noqa: E402
import kernels as kernel_benchmark  # noqa: E402
import o1_transformer  # noqa: E402
import per_call  # noqa: E402
import scaler as scaler_benchmark  # noqa: E402
import step_costs  # noqa: E402
import step_kernels  # noqa: E402
import variants  # noqa: E402
import workloads  # noqa: E402
from measure import peak_memory, python_calls, settle  # noqa: E402

MIB = 2**20


@pytest.mark.slow
def test_run_all_quick_prints_the_summary():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--tiny"],
        capture_output=True,
        text=True,
        timeout=1200,  # about 2 CPU-minutes; the shared build machine can stretch that 4x
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout[result.stdout.index("summary on") :]
    for row in (
        "transformer step",
        "loss scaling + step",
        "per-call overhead",
        "kernels",
        "step costs",
        "amp O2, transformer-w16-d16-s8",
        "amp O3, transformer-w64-d4-s32",
        "manual O2 fused, cnn-tiny",
        "gpt2 (tiny) step",
        "resnet50 (tiny) step",
    ):
        assert row in summary
    assert "did not train" not in summary
    assert "Ran on the CPU" in summary.splitlines()[-1]


@pytest.mark.parametrize("form", list(module_walk.FORMS))
def test_a_settled_o2_step_walks_at_most_9_modules_with_16_transitions(form):
    """One owner per parameter's state: the step goes from the optimizer's record to the fused
    step, the kernels and the rows' marks, and back, without bouncing between modules; a state
    dict taken before costs later forwards nothing."""
    step, before, after = module_walk.walk("adamw", torch.bfloat16, state_dict=True, form=form)
    assert len(step.modules) <= 9 and step.transitions <= 16, " > ".join(step.visits)
    assert step.visits[-4:] == ["weights/fused_step", "kernels", "weights/rows", "weights/optimizer"]
    assert after == before


def test_o1_transformer_runs_every_variant_at_its_smallest_size(capsys):
    sizes = ["--width", "8", "--batch", "1", "--length", "4", "--layers", "1"]
    results = o1_transformer.main(["--steps", "1", "--rounds", "1", "--device", "cpu", *sizes])
    assert list(results) == ["fp32", "torch.autocast", "amp O1", "amp.autocast"]
    assert all(row["time"] > 0 for row in results.values())
    assert results["torch.autocast"]["/ torch.autocast"] == 1.0  # the ratios' reference
    printed = capsys.readouterr().out
    assert all(name in printed for name in results)


def test_per_call_benchmark_gives_each_case_against_torch(capsys):
    threads = torch.get_num_threads()
    table = per_call.main(["--device", "cpu", "--number", "2", "--repeat", "1"])
    assert torch.get_num_threads() == threads  # one thread while it measured, then as before
    ops = ["F.linear", "torch.matmul", "F.conv2d", "F.softmax", "Tensor.sum", "Tensor.add"]
    assert [row["case"] for row in table] == [
        *(f"{op}, {variant}" for op in ops for variant in ("amp.autocast", "amp O1")),
        "F.linear, weights cast anew, amp.autocast",
        "region enter + exit",
        "region enter + exit, one device",
        "F.linear outside any region",
    ]
    for row in table:
        assert row["amp / torch"] == row["amp"] / row["torch"]
        assert row["amp - torch"] == row["amp"] - row["torch"]
    assert "host time per patched call, bfloat16 on cpu" in capsys.readouterr().out


def test_scaler_benchmark_runs_its_three_variants_at_its_smallest_size(capsys):
    medians = scaler_benchmark.main(
        ["--tensors", "2", "--steps", "1", "--rounds", "1", "--device", "cpu"]
    )
    assert list(medians) == ["plain", "torch GradScaler", "amp"]
    assert all(seconds > 0 for seconds in medians.values())
    assert "loss scaling + step, 2 parameter tensors, cpu" in capsys.readouterr().out


def test_kernel_benchmark_measures_each_case_once(monkeypatch, capsys):
    """Each comparison measured once (the sizes are fixed); the rows' derived columns are the
    arithmetic of what was measured."""
    compare = kernel_benchmark.Timer.compare
    monkeypatch.setattr(
        kernel_benchmark.Timer,
        "compare",
        lambda self, a, b, repeat=15, inner=1, wall=False: compare(self, a, b, 1, 1, wall),
    )
    rows = kernel_benchmark.main()
    assert [row["case"] for row in rows] == [
        "large unscale (32 MiB)",
        "1000 small tensors",
        "fp16 grads -> fp32 masters",
        "fp32 masters -> fp16 params",
        "l2 norm, 300 tensors",
    ]
    for row in rows:
        assert row["amp / torch"] == row["amp"] / row["torch"]
    assert rows[0]["amp GB/s"] == 8 * 2**23 / rows[0]["amp"] / 1e9  # read and write, FP32
    assert rows[2]["amp GB/s"] == 6 * 2**22 / rows[2]["amp"] / 1e9  # FP16 read, FP32 write
    assert "kernels on cpu" in capsys.readouterr().out


@pytest.mark.skipif(build.compiler() is None, reason="needs g++ for the emulated grid")
@pytest.mark.parametrize("case", [name for name in step_kernels.CASES if "torch" not in name])
def test_step_kernels_counts_the_bytes_each_kernel_moves(monkeypatch, case):
    """The bytes step_kernels.py divides by are kernel_work's count of the launches (the kernels
    compiled for the CPU), less Adam's step counts: 12 bytes a tensor."""
    import amp
    import kernel_work

    module, _ = fake_cupy.install(monkeypatch, kernels="compiled")
    monkeypatch.setattr(amp.kernels, "_backend", lambda device: module)
    sizes = [32 * 40 + 7] * step_kernels.TENSORS
    step, moved = step_kernels.CASES[case](sizes, torch.device("cpu"))
    with kernel_work.kernel_traffic() as work:
        step()
    counts = 12 * len(sizes) if case.startswith("adam") else 0
    assert work.bytes - counts == pytest.approx(moved, rel=1e-3)


def test_step_kernels_runs_every_case_against_torch_and_a_copy(capsys):
    (rows,) = step_kernels.main(["--tiny"]).values()
    assert [row["kernel"] for row in rows] == list(step_kernels.CASES)
    assert all(row["time"] > 0 and row["/ copy"] > 0 for row in rows)
    assert rows[0]["/ torch fused"] == 1.0
    assert "Step kernels alone, 2M parameters" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["gpt2-tiny", "resnet50-tiny"])
def test_every_variant_trains_the_end_to_end_models(model):
    workload = workloads.END_TO_END[model]
    table = end_to_end.run(workload, variants.VARIANTS, torch.bfloat16, "cpu", steps=1, warmup=0)
    assert [row["variant"] for row in table] == list(variants.VARIANTS)
    for row in table:
        assert row["trained"], row["variant"]
        assert row["calls"] > 100
    (reference,) = [row for row in table if row["variant"] == "torch.autocast"]
    assert reference["time / torch.autocast"] == reference["calls / torch.autocast"] == 1.0


def test_manual_o2_steps_fp32_masters_and_keeps_batch_norm_fp32():
    model = workloads.END_TO_END["resnet50-tiny"].build("cpu")
    trainer = variants.setup("manual O2 fused", model, workloads.loss_fn, torch.bfloat16)
    assert model.conv1.weight.dtype == torch.bfloat16
    assert model.bn1.weight.dtype == torch.float32
    before = model.conv1.weight.detach().clone()
    trainer.step(*workloads.END_TO_END["resnet50-tiny"].batch("cpu"))
    assert not torch.equal(before, model.conv1.weight)
    assert all(p.grad is None for p in model.parameters())  # freed once copied to the masters


class _Allocates:
    """A trainer that holds 3 MiB and whose step holds 1 MiB and then 0.5 MiB more."""

    model = None

    def __init__(self):
        self.kept = torch.ones(3 * MIB, dtype=torch.uint8)

    def step(self, inputs, targets):
        first = torch.ones(MIB, dtype=torch.uint8)
        second = torch.ones(MIB // 2, dtype=torch.uint8)
        del first, second
        return None

    def close(self):
        pass


def test_peak_memory_counts_the_allocators_bytes_on_cpu():
    no_data = lambda: (None, None)  # noqa: E731
    before, peak = peak_memory(_Allocates, no_data, no_data, "cpu")
    assert before == 3 * MIB
    assert peak == before + MIB + MIB // 2


def test_python_calls_counts_each_call_of_one_step():
    class Calls:
        def __init__(self, count):
            self.count = count

        def step(self, inputs, targets):
            for _ in range(self.count):
                abs(inputs)

        def loss_scale(self):
            return None

    assert python_calls(Calls(10), (1, None)) - python_calls(Calls(0), (1, None)) == 10


def test_settle_steps_past_the_skips_and_the_step_after_them():
    class Skips:
        """Halves its scale on each of its first `skips` steps, as float16's first steps do."""

        def __init__(self, skips):
            self.skips, self.scale, self.steps = skips, 65536.0, 0

        def step(self, inputs, targets):
            self.steps += 1
            if self.steps <= self.skips:
                self.scale /= 2

        def loss_scale(self):
            return self.scale

    trainer = Skips(3)
    assert settle(trainer, (None, None)) == 5  # three skips, then two steps that keep the scale
    assert trainer.scale == 65536.0 / 8
    with pytest.raises(RuntimeError, match="still changed after 4 steps"):
        settle(Skips(10), (None, None), limit=4)


def test_step_costs_count_and_weigh_every_variant():
    workload = workloads.host_bound_transformer(1)
    names = list(variants.VARIANTS)
    counted = step_costs.calls(workload, names, torch.bfloat16, "cpu", "default")
    measured = step_costs.memory(workload, names, torch.bfloat16, "cpu", "default")
    rows = step_costs.rows(workload.name, names, counted, measured)
    assert [row["variant"] for row in rows] == names
    assert rows[names.index("torch.autocast")]["peak / torch.autocast"] == 1.0
    for name in names:
        before, peak = measured[name]
        assert 0 < before < peak, name
        assert counted[name] > 100, name
    # FP32 with AdamW holds each parameter, its gradient and two moments when a step starts;
    # O3 holds all of them in bfloat16.
    parameter_bytes = 4 * sum(p.numel() for p in workload.build("cpu").parameters())
    assert measured["fp32"][0] >= 4 * parameter_bytes
    assert measured["amp O3"][0] < measured["fp32"][0] * 0.6


def test_step_costs_times_the_variants_in_rotating_rounds(monkeypatch):
    """--time: every round builds each variant afresh and times it; the ratio column is the
    median of the per-round ratios (here on a clock that counts the steps, not seconds)."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(step_costs.time, "thread_time", lambda: float(next(ticks)))
    workload = workloads.host_bound_transformer(1)
    names = ["torch.autocast", "amp O2"]
    timed = step_costs.host_time(workload, names, torch.bfloat16, "cpu", "default", 2, 3)
    assert {name: len(times) for name, times in timed.items()} == {name: 2 for name in names}
    assert all(t == 1.0 for times in timed.values() for t in times)  # one tick per timed step
    rows = step_costs.rows(workload.name, names, {}, {}, timed)
    assert [(row["time"], row["time / torch.autocast"]) for row in rows] == [(1.0, 1.0)] * 2


def test_step_costs_report_the_calls_loss_scaling_adds_at_every_level():
    table = step_costs.scaling_rows()
    assert [row["opt level"] for row in table] == ["O0", "O1", "O2", "O2", "O3"]
    assert [row["dtype"] for row in table] == ["bfloat16"] * 2 + ["float16"] + ["bfloat16"] * 2
    reference = {row["torch.amp.GradScaler calls"] for row in table}
    assert len(reference) == 1 and reference.pop() > 20
    # O0 and O3 scale statically; O2's fused step stands in for the optimizer's own step
    assert table[0]["amp calls"] == table[4]["amp calls"] > 0 and table[2]["amp calls"] > 0
    # O2 bf16 decodes and encodes its exact masters: tests/scaling holds its calls fixed
    assert all(row["amp calls"] <= row["torch.amp.GradScaler calls"] for row in table[:3] + table[4:])


def test_transformers_trainer_benchmark_counts_every_variant(one_thread):
    """benchmarks/transformers_trainer.py at CI sizes: each variant's calls and memory counted,
    the ratios taken to the Trainer's own bf16."""
    pytest.importorskip("transformers", minversion="5")  # the `transformers` extra
    import transformers_trainer

    rows = transformers_trainer.main(["--tiny", "--steps", "3", "--warmup", "1", "--device", "cpu"])
    assert [row["variant"] for row in rows] == list(transformers_trainer.VARIANTS)
    by_name = {row["variant"]: row for row in rows}
    for row in rows:
        assert row["calls/step"] > 100 and 0 < row["start MiB"] < row["peak MiB"]
        assert row["loss"] < 6.0  # finite, near ln 256 = 5.55 after three steps
    reference = by_name["Trainer bf16=True"]
    assert reference["calls / bf16=True"] == reference["peak / bf16=True"] == 1.0
    # O2 holds the bf16 model and its exact masters' int16 remainders: the bytes of O1's FP32
    # model (before its first step, neither holds moments)
    assert by_name["AmpTrainer O2 bf16"]["start MiB"] == by_name["AmpTrainer O1 bf16"]["start MiB"]
