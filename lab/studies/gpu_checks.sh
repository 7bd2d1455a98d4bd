#!/bin/bash
# The GPU checks behind lab/RESULTS.md "On a CUDA GPU", as one script for a machine with a
# CUDA GPU (run from a checkout's root; results go to OUT, default gpu-checks/):
#   1. calibration on the GPU against the CPU (lab.studies.cuda_calibration),
#   2. compress DeiT-B on the GPU, then `bench` dense against compressed on torch-cpu and torch-cuda
#      (and ort/trt where ONNX Runtime's GPU build or TensorRT are installed: an export is made first),
#   3. compress cost on the GPU (lab.studies.compress_cost --device cuda),
#   4. the CLI, bench, export and reliability tests with the GPU present,
#   5. half precision: dense against compressed DeiT-B in fp16 and bf16, the attention kernel each
#      ran, and the head-dim levers (lab.studies.half_precision),
#   6. `bench --torch-precision fp16` and `bf16` through the command line,
#   7. recovery's cost on the GPU for DeiT-B, fp32 and bf16 autocast (lab.studies.recovery_cost).
# STEPS picks some (e.g. STEPS=5,6,7; default all). Each step has its own time limit so that one slow step does not cost the others. Where the project
# is not installed, it runs from the checkout (PYTHONPATH) with the corp-deploy entry point; carry
# missing dependencies as wheels and install them with `python3 -m pip install --no-index --no-deps`
# (a bare `pip` there may belong to another interpreter).
set -u
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
corp() { python3 -c "from corp_deploy.launch import main; main()" "$@"; }
export -f corp
nvidia-smi -L
python3 -c "import torch, timm, onnxruntime as ort; print('torch', torch.__version__, 'timm', timm.__version__, \
'ort', ort.__version__, ort.get_available_providers())"
want() { [[ ",${STEPS:-all}," == *",all,"* || ",${STEPS}," == *",$1,"* ]]; }
step() { echo "== $1 ($(date +%T))"; }

if want 1; then
step "1 calibration on the GPU against the CPU"
timeout 300 python3 -m lab.studies.cuda_calibration --model deit_small --images 64 \
    --out "$OUT/cuda_calibration_deit_small.json"
fi

art=$(mktemp -d)/deit_base-s0.5
if want 2 || want 6; then
timeout 120 bash -c "corp compress deit_base --no-pretrained --s 0.5 --device cuda --calib-samples 64 -o $art" | tail -3
fi
if want 2; then
step "2 compress on the GPU, export, bench"
timeout 300 bash -c "corp export $art --dense --trt" | tail -5
timeout 300 bash -c "corp bench $art --backends torch,ort,trt --batch 1,8,64 --min-time 2 -o $OUT/bench_deit_base_s0.5"
fi

if want 3; then
step "3 compress cost on the GPU"
timeout 300 python3 -m lab.studies.compress_cost --model deit_base --images 256 --rounds 2 \
    --modes independent,budget --macs 0.6 --device cuda --out "$OUT/compress_cost_deit_base_cuda.json"
fi

if want 4; then
step "4 tests with the GPU present"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # with -n 8: 166 s on the H100 machine
timeout 400 python3 -m pytest -q -m "not slow" $xdist -p no:cacheprovider -rf tests/test_cli.py tests/test_bench.py \
    tests/test_export_cli.py tests/test_reliability.py tests/test_runners.py 2>&1 | tail -20
fi

if want 5; then
step "5 half precision: latency, speedup and attention kernels of the head-dim levers"
timeout 270 python3 -m lab.studies.half_precision --model deit_base_patch16_224 --device cuda \
    --precisions fp32,fp16,bf16 --batches 1,8,64 --out "$OUT/half_precision_deit_base.json" | cut -c1-300
fi

if want 6; then
step "6 bench in fp16 and bf16 through the command line"
for precision in fp16 bf16; do
    timeout 100 bash -c "corp bench $art --backends torch --batch 1,64 --min-time 0.5 --data-samples 32 \
        --torch-precision $precision --json $OUT/bench_deit_base_s0.5_$precision.json" 2>&1 | tail -14
done
fi

if want 7; then
step "7 recovery's cost on the GPU (DeiT-B, fp32 and bf16 autocast)"
timeout 200 python3 -m lab.studies.recovery_cost --model deit_base_patch16_224 --device cuda \
    --precisions fp32,bf16 --steps 6 --images 64 --out "$OUT/recovery_cost_deit_base_cuda.json"
fi
step "done"
