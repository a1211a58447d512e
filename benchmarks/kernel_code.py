"""What each fused step kernel costs per element, read off its machine code: a CPU proxy for
the step's speed on a GPU (benchmarks/step_kernels.py measures it there).

    python benchmarks/kernel_code.py [--arch sm_90] [--sass-of KERNEL] [--source FILE]

(--source: one .cu file in place of the families' files, e.g. an earlier commit's
`git show 3e30ccf:amp/kernels/multi_tensor.cu > /tmp/before.cu`.)

Compiles the kernels' source as CuPy does (NVRTC's options: -std=c++17, the 32 KB parameter
layout, -ftz=true last) with nvcc for one architecture, disassembles the cubin with cuobjdump
(nvcc's, or the `nvidia-cuda-cuobjdump` wheel's; set CUOBJDUMP to point at one) and prints, per
step kernel:

  B/elem     the bytes a step must move per parameter (benchmarks/step_kernels.py's count)
  regs       registers per thread (cuobjdump -res-usage), and the blocks of 512 threads and the
             share of the SM's 64 warps they leave room for (65,536 registers and 228 KiB of
             shared memory per SM, registers allocated 256 per warp)
  loop       SASS instructions one trip of the kernel's element loop issues on its common path:
             the loop is the innermost backward branch whose body holds vector global accesses
             (64 or 128 bits), else the one with the most global loads; at each branch the path
             takes the side that calls nothing (a call is a slow path: the division's or the
             square root's for operands out of range, an 8-bit code's exact fallback)
  elem/trip  the elements one thread steps per trip of that loop: the source's kStepElements
             where the loop accesses vectors; else its global loads over the loads of one element
             (the compiler unrolls a loop of one element a thread)
  instr/elem loop / elem/trip: the instructions a thread issues per element on the fast path
  mufu, shfl per element: the quarter-rate special-function and warp-shuffle instructions in it

At a given share of the issue rate, a kernel is bound by instructions rather than by memory when
instr/elem x elements per second exceeds the SMs' issue rate: an H200 issues about
132 SMs x 4 x 32 lanes x 1.98 GHz = 33 T thread-instructions a second, so streaming 12.5 bytes a
parameter at 3 TB/s (240 G parameters a second) leaves about 140 instructions a parameter at
full issue, about 100 at the 70% a memory-bound kernel issues at.
"""

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from amp.kernels import _layout, _sources  # noqa: E402

# (kernel, bytes a step moves per parameter, global loads per element where a thread loads one
# element at a time): benchmarks/step_kernels.py's cases and the others a bf16 model's O2 takes.
KERNELS = [
    ("amp_adam<__nv_bfloat16, __nv_bfloat16>", 28.0, 4),
    ("amp_compact_adam<__nv_bfloat16, amp::Remainder, float>", 26.0, 5),
    ("amp_compact_adam<__nv_bfloat16, amp::Compact, __nv_bfloat16>", 16.0, 5),
    ("amp_compact_adam<__nv_bfloat16, amp::Compact, amp::Codes8>", 12.5, 7),
    ("amp_sgd<__nv_bfloat16, __nv_bfloat16>", 20.0, 3),
    ("amp_compact_sgd<__nv_bfloat16, amp::Remainder, float>", 18.0, 4),
    ("amp_compact_sgd<__nv_bfloat16, amp::Compact, amp::Codes8>", 10.25, 5),
]
THREADS = 512
SM_REGISTERS = 65536
SM_WARPS = 64
SM_BLOCKS = 32
SM_SHARED = 228 * 1024
BLOCK_SHARED_RESERVED = 1024  # the driver's per-block share
_ACCESS = re.compile(r"\b(LDG|STG)\.E(\.\w+)*")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_VECTOR = re.compile(r"\b(LDG|STG)\.E\.(64|128)")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def cuobjdump():
    """A cuobjdump: $CUOBJDUMP, on PATH, or in an installed nvidia-cuda-cuobjdump wheel."""
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for candidate in sorted(site.glob("nvidia/**/bin/cuobjdump")):
        return str(candidate)
    raise SystemExit(
        "no cuobjdump: pip install nvidia-cuda-cuobjdump (or set CUOBJDUMP=/path/to/cuobjdump)"
    )


def compile_cubin(arch, folder, text):
    """Source `text` compiled by nvcc as CuPy compiles it; the cubin's path."""
    source = folder / "kernels.cu"
    source.write_text(text)
    cubin = folder / "kernels.cubin"
    options = ["-std=c++17", *_layout.compile_options(_layout.PARAM_BYTES_LARGE)]
    options += list(_sources.GPU_OPTIONS) + ["-ftz=true"]  # CuPy appends -ftz=true last
    subprocess.run(
        ["nvcc", f"-arch={arch}", "-cubin", *options, str(source), "-o", str(cubin)], check=True
    )
    return cubin


def _demangled(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines()


def functions(cubin, tool):
    """{kernel name as the source instantiates it: (registers, shared bytes, [(address, text)])}."""
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True)
    usage = subprocess.run(
        [tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    resources = {
        name: (int(registers), int(shared))
        for name, registers, shared in re.findall(
            r"Function (\S+):\s*\n\s*REG:(\d+) STACK:\d+ SHARED:(\d+)", usage
        )
    }
    bodies, current = {}, None
    for line in sass.stdout.splitlines():
        header = re.search(r"Function : (\S+)", line)
        if header:
            current = bodies.setdefault(header.group(1), [])
            continue
        match = _LINE.search(line)
        if current is not None and match:
            current.append((int(match.group(1), 16), match.group(2)))
    mangled = list(bodies)
    out = {}
    for name, readable in zip(mangled, _demangled(mangled)):
        key = readable.split("(")[0].removeprefix("void ").strip()
        registers, shared = resources.get(name, (0, 0))
        out[key] = (registers, shared, bodies[name])
    return out


def element_loop(body):
    """The instructions of the element loop (see the module doc)."""
    loops = []
    for index, (address, text) in enumerate(body):
        branch = _BRANCH.search(text)
        if not branch or "CALL" in text:
            continue
        target = int(branch.group(1), 16)
        if target < address:
            start = next(i for i, (a, _) in enumerate(body) if a >= target)
            loops.append(body[start : index + 1])
    with_access = [loop for loop in loops if any(_ACCESS.search(t) for _, t in loop)]
    if not with_access:
        return []

    def vector(loop):
        return sum(bool(_VECTOR.search(t)) for _, t in loop)

    def innermost(loop):  # no other candidate inside it
        return not any(o is not loop and o[0][0] >= loop[0][0] and o[-1][0] <= loop[-1][0]
                       for o in with_access)

    inner = [loop for loop in with_access if innermost(loop)] or with_access
    if any(vector(loop) for loop in inner):
        return max(inner, key=vector)
    return max(inner, key=lambda loop: sum(bool(_ACCESS.search(t)) for _, t in loop))


def _block_calls(body, start):
    """Whether the straight-line code from body[start] to the next branch or barrier calls."""
    for _, text in body[start:]:
        if "CALL" in text:
            return True
        if re.search(r"\b(BRA|EXIT|BSYNC|RET)\b", text):
            return False
    return False


def _common_path(loop):
    """The instructions one trip of the loop issues on its common path: at each conditional
    branch, the jump over code that calls and moves no data (a call is a slow path: the
    division's or the square root's for operands out of range, an exact fallback) unless the
    jump's target calls too, else the fall-through."""
    index = {address: i for i, (address, _) in enumerate(loop)}
    path, i = [], 0
    while i < len(loop):
        address, text = loop[i]
        path.append((address, text))
        branch = _BRANCH.search(text)
        if branch and "CALL" not in text and "BRA.DIV" not in text:  # (taken if diverged)
            target = int(branch.group(1), 16)
            if target <= address or target not in index:
                break  # the back edge: the trip is over
            if not text.startswith("@"):
                i = index[target]
                continue
            skipped = [t for _, t in loop[i + 1 : index[target]]]
            slow = any("CALL" in t for t in skipped) and not any(
                re.search(r"\b(LDG|STG|SHFL)\b", t) for t in skipped  # real work: not a slow path
            )
            if slow and not _block_calls(loop, index[target]):
                i = index[target]
                continue
        i += 1
    return path


def occupancy(registers, shared):
    per_warp = -(-registers * 32 // 256) * 256
    warps_per_block = THREADS // 32
    blocks = min(SM_REGISTERS // (per_warp * warps_per_block) if per_warp else SM_BLOCKS,
                 SM_BLOCKS, SM_WARPS // warps_per_block)
    if shared:
        blocks = min(blocks, SM_SHARED // (shared + BLOCK_SHARED_RESERVED))
    return blocks, blocks * warps_per_block / SM_WARPS


def rows(arch="sm_90", text=None):
    tool = cuobjdump()
    text = text or _sources.source(_sources.STEP_FAMILIES, [kernel for kernel, *_ in KERNELS])
    with tempfile.TemporaryDirectory() as folder:
        compiled = functions(compile_cubin(arch, pathlib.Path(folder), text), tool)
    found = re.search(r"constexpr int kStepElements = (\d+);", text)
    per_trip = int(found.group(1)) if found else 1
    table = []
    for kernel, bytes_per_element, loads in KERNELS:
        registers, shared, body = compiled[kernel]
        loop = _common_path(element_loop(body))
        if any(_VECTOR.search(t) for _, t in loop):
            elements = per_trip
        else:
            elements = sum(bool(re.search(r"\bLDG\b", t)) for _, t in loop) // loads
        blocks, share = occupancy(registers, shared)
        count = len(loop)
        mufu = sum("MUFU" in t for _, t in loop)
        shfl = sum("SHFL" in t for _, t in loop)
        table.append(
            (kernel, bytes_per_element, registers, blocks, share, count, elements,
             count / elements, mufu / elements, shfl / elements)
        )
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--sass-of", help="print this kernel's element loop")
    parser.add_argument("--source", help="compile this .cu file instead")
    args = parser.parse_args()
    text = pathlib.Path(args.source).read_text() if args.source else None
    if args.sass_of:
        with tempfile.TemporaryDirectory() as folder:
            text = text or _sources.source(_sources.STEP_FAMILIES, [args.sass_of])
            compiled = functions(compile_cubin(args.arch, pathlib.Path(folder), text), cuobjdump())
        for address, text in _common_path(element_loop(compiled[args.sass_of][2])):
            print(f"{address:05x}  {text}")
        return
    print(f"| kernel ({args.arch}) | B/elem | regs | blocks/SM | occupancy | loop | elem/trip "
          "| instr/elem | mufu/elem | shfl/elem |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows(args.arch, text):
        kernel, nbytes, regs, blocks, share, count, elements, per, mufu, shfl = row
        print(f"| `{kernel}` | {nbytes:g} | {regs} | {blocks} | {share:.0%} | {count} | "
              f"{elements} | {per:.1f} | {mufu:.2f} | {shfl:.2f} |")


if __name__ == "__main__":
    main()
