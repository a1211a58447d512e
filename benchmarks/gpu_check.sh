#!/bin/bash
# What a lent GPU is for, in parts sized to a 15-minute lease. For a machine with a CUDA torch,
# CuPy and no network:
#     bash benchmarks/gpu_check.sh LOG_DIR [PART...]
# Parts (default: all but the last three, about 9 minutes on an H200; float8, lightning and
# transformers together about 5 more: give them a lease of their own):
#   env           the GPU, torch, CuPy; each kernel family's first-use compile time (first_use.py)
#   cuda_tests    pytest -m cuda (AMP_REQUIRE_CUDA=1: a skip for want of CUDA fails)
#   step_kernels  each fused step kernel alone, 100M and 470M parameters (step_kernels.py)
#   gpt2          GPT-2 small, bf16 and fp16: step, host time, peak and held bytes a parameter
#   kernels       the unscale / copy / norm kernels against torch's (kernels.py)
#   float8        the FP8 cast kernels' CUDA tests, then the MLP stack eager and compiled
#                 (float8_mlp.py: amp O2 bf16, + float8 tensorwise / rowwise, torchao beside)
#   lightning     examples/lightning.py on CUDA: O1, O2 and compact + int8 fits, each resumed
#   transformers  examples/transformers_finetune.py on CUDA: O1 fp16, O2 bf16, compact + int8
# torch's test helpers need `expecttest`, the float8 peers `torchao`: bring their wheels if the
# machine lacks them. Each part has its own time limit so that one hang does not eat the lease;
# the logs keep every table.
LOGS=${1:-gpu-logs}
shift
PARTS=${*:-env cuda_tests step_kernels gpt2 kernels}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 AMP_REQUIRE_CUDA=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . -e ./compat/apex
run() {  # run LIMIT NAME COMMAND...: the command's output into LOGS/NAME.txt, its last lines here
  local limit=$1 name=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  echo "exit $?" >> "$LOGS/$name.txt"
  tail -n 40 "$LOGS/$name.txt"
}
GPT2="--models gpt2 --optimizer fused --steps 10 --warmup 3"
for part in $PARTS; do
  case $part in
    env) run 120 env sh -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, amp, cupy; print(\"torch\", torch.__version__, \"amp\", amp.__version__, \"cupy\", cupy.__version__)"
python3 benchmarks/first_use.py' ;;
    cuda_tests) run 140 cuda_tests python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider -m cuda ;;
    step_kernels) run 70 step_kernels python3 benchmarks/step_kernels.py ;;
    gpt2) run 200 gpt2 sh -c "python3 benchmarks/end_to_end.py $GPT2 --dtype bfloat16 \
--variants torch.autocast 'amp O1' 'amp O2' 'amp O2 compact' 'amp O2 compact int8' \
'amp O2 bf16 no masters' && python3 benchmarks/end_to_end.py $GPT2 --dtype float16 \
--variants torch.autocast 'amp O1' 'amp O2' && AMP_DISABLE_KERNELS=1 python3 \
benchmarks/end_to_end.py $GPT2 --dtype bfloat16 --variants torch.autocast 'amp O2'" ;;
    kernels) run 120 kernels python3 benchmarks/kernels.py ;;
    float8) run 200 float8 sh -c "python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
-m cuda tests/kernels/test_float8_kernels.py tests/casting/test_float8_eager.py; \
python3 benchmarks/float8_mlp.py --device cuda --modes eager compiled" ;;
    lightning) run 150 lightning python3 examples/lightning.py --device cuda ;;
    transformers) run 150 transformers sh -c "python3 examples/transformers_finetune.py \
--device cuda --opt-level O1 --dtype float16 --overflow-step 3 && \
python3 examples/transformers_finetune.py --device cuda && \
python3 examples/transformers_finetune.py --device cuda --compact" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
