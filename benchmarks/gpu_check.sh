#!/bin/bash
# Everything a lent GPU is for, in one call: the CUDA tests, the kernels, GPT-2 small / ResNet-50
# end to end, and run_all. For a machine with a CUDA torch, CuPy and no network:
#     bash benchmarks/gpu_check.sh [LOG_DIR]     (LOG_DIR: default ./gpu-logs)
# torch's test helpers need `expecttest`; bring its wheel if the machine lacks it. Each part has
# its own time limit so that one hang does not eat the lease; the logs keep every table.
LOGS=${1:-gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 AMP_REQUIRE_CUDA=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . -e ./compat/apex
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, amp; from amp import kernels
print('torch', torch.__version__, 'amp', amp.__version__, kernels.cuda_backend())"
} 2>&1 | tee "$LOGS/env.txt"
run() {  # run LIMIT NAME COMMAND...: the command's output into LOGS/NAME.txt, its last lines here
  local limit=$1 name=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  echo "exit $?" >> "$LOGS/$name.txt"
  tail -n 12 "$LOGS/$name.txt"
}
run 200 cuda_tests python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider -m cuda
run 120 kernels python3 benchmarks/kernels.py
run 300 end_to_end python3 benchmarks/end_to_end.py
run 600 run_all python3 benchmarks/run_all.py
run 600 other_tests python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -m "not cuda"
