#!/usr/bin/env bash
# The GPU checks, in one call, for a session that is lent a GPU machine (README, "GPUs"):
#   run(command="bash scripts/device_check.sh", timeout_s=580)
# That machine has its own python3 with a CUDA torch, h5py, pandas, pybind11 and pytest, and can
# fetch nothing. This builds the statistics kernel in place, runs every test marked `cuda`, the GPU
# ablation on gpt and Llama (each step synchronized) and the host microseconds a record. Logs and
# the benchmark's JSON go to $OUT, else ./device_check.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__,
torch.cuda.is_available())" 2>&1 | tee "$out/versions.txt"
if ! python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1; then
    echo "build failed (the tests run on what was built): $out/build.log"
fi
python3 -c "import torch, tracer.storage._stats_kernel; print('statistics kernel built')" 2>&1 \
    | tee -a "$out/versions.txt"
# each step has its own timeout; the whole stays within 10 minutes
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/tracer tests/profiler \
    2>&1 | tee "$out/cuda_tests.log"
# the batched path is opt-in until this passes: its cuda tests set SLEUTH_BATCHED_STATS
# themselves; the ablation runs per-record (default) and batched side by side
for batched in 0 1; do
    SLEUTH_BATCHED_STATS=$batched timeout 150 python3 benchmarks/tracer_ablation.py \
        --device cuda --workloads gpt,llama --rounds 2 --steps 3 --devices triton_stats \
        --conditions module_statistics,op_statistics,attached_unselected \
        > "$out/tracer_ablation_cuda_batched$batched.json" \
        2> "$out/tracer_ablation_cuda_batched$batched.err"
    echo "ablation (SLEUTH_BATCHED_STATS=$batched) exit $?"
done
SLEUTH_BATCHED_STATS=1 timeout 60 python3 benchmarks/record_host_cost.py --device cuda \
    --rounds 3 --steps 5 > "$out/record_host_cost_cuda.json" 2> "$out/record_host_cost_cuda.err"
echo "host cost exit $?; results in $out"
