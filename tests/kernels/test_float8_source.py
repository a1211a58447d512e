"""The FP8 casts' source (_sources.FLOAT8_FILES, concatenated) compiles with nvcc as CuPy compiles
it (its Meta the size of the host's mirror), and its float arithmetic keeps subnormals under
CuPy's -ftz=true; the Meta packing (_float8_layout)."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

from amp.kernels import _float8_layout, _sources

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _nvcc(tmp_path, arch, *options):
    source = tmp_path / "float8.cu"
    source.write_text(_sources.float8_source())
    output = tmp_path / f"float8-{arch}.out"
    result = subprocess.run(
        ["nvcc", "-std=c++17", f"-arch={arch}", *options, str(source), "-o", str(output),
         *_float8_layout.compile_options()],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return output


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_the_hosts_meta(tmp_path, arch):
    _nvcc(tmp_path, arch, "-c")


@needs_nvcc
def test_ptx_converts_in_hardware_and_keeps_subnormals_with_ftz(tmp_path):
    text = _nvcc(tmp_path, "compute_90", "-ptx", "-ftz=true").read_text()
    assert "cvt.rn.satfinite.e4m3x2.f32" in text and "cvt.rn.satfinite.e5m2x2.f32" in text
    for op in ("mul", "div"):
        assert f"{op}.rn.f32" in text and f"{op}.rn.ftz.f32" not in text, op
    assert ".local" not in text  # the Meta is read from parameter space, never copied


class _Job:
    def __init__(self, rows, cols, **pointers):
        self.src = torch.empty(rows, cols)
        for name in _float8_layout.POINTERS[1:]:
            setattr(self, name, pointers.get(name))
        self.per_row, self.per_col = 1, 0


def test_metas_hold_24_jobs_with_their_first_tiles():
    jobs = [_Job(1 + 100 * i, 200) for i in range(30)]
    packed = _float8_layout.metas(jobs)
    assert [record[0]["njobs"] for record, _ in packed] == [24, 6]
    first = packed[1][0][0]["jobs"]["first_tile"][:6]
    tiles = [_float8_layout.tiles(1 + 100 * i, 200) for i in range(24, 30)]
    assert first.tolist() == np.cumsum([0] + tiles[:-1]).tolist()
    assert packed[1][1] == sum(tiles)
    entry = packed[0][0][0]["jobs"][3]
    assert entry["src"] == jobs[3].src.data_ptr() and entry["out"] == 0
    assert (entry["rows"], entry["cols"], entry["per_row"]) == (301, 200, 1)
    assert _float8_layout.META.itemsize <= 4096 - 16  # with the kernels' other parameters


def test_tiles_cover_partial_tiles():
    assert _float8_layout.tiles(1, 1) == 1
    assert _float8_layout.tiles(128, 129) == 2
    assert _float8_layout.tiles(16384, 4096) == 128 * 32
    assert _float8_layout.tiles(0, 5) == 0



def test_source_includes_only_what_nvrtc_finds():
    """CuPy compiles with NVRTC, which has CUDA's headers but no C library (<string.h> fails)."""
    includes = [line.split()[1] for line in _sources.float8_source().splitlines()
                if line.startswith("#include")]
    assert includes == ["<cuda_fp16.h>", "<cuda_bf16.h>"]
