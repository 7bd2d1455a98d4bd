#!/bin/bash
# Issue 63's GPU checks in one call on a machine with a CUDA GPU (estimated 6-7 minutes on an H200;
# not run yet), from a checkout's root; every result is JSON (and bench's Markdown) under OUT_DIR:
#   bash lab/studies/gpu_timing.sh OUT_DIR
# DeiT-B with random weights compressed at s = 0.5 on the GPU, then:
#   1. eager PyTorch, fp16 and fp32, batch 1, 8, 64 (`bench --backends torch`): each row device-resident,
#      host-to-host beside it (bench_eager_fp16.json, bench_eager_fp32.json);
#   2. the same two models timed standalone with CUDA events (lab.studies.cuda_events) at fp16
#      batch 64, against bench's device-resident speedup in bench_eager_fp16.json (goal: within 5 %);
#   3. CUDA graphs, fp16 and fp32, batch 1, 8, 64 (`bench --cuda-graphs`: bench_graphs_*.json);
#   4. the torch-compile backend (inductor, default mode), fp16, batch 1 and 64: speedup and each
#      model's compile time (bench_compile_fp16.json);
#   5. ATen operators and CUDA kernels per forward, dense against compressed, fp16 and fp32, batch 1
#      (lab.studies.ops_per_forward: ops_per_forward.json).
# DEVICE=cpu is the dry run before a GPU is lent (3.5 minutes on a 2-core CPU): a small ViT (MODEL and
# MODEL_ARGS), bf16 for fp16, step 3 left out (CUDA graphs need CUDA: bench refuses them) and step 5
# on deit_tiny in fp32.
# Each step has its own time limit, so that one slow step does not cost the others.
set -u
OUT=${1:?usage: bash lab/studies/gpu_timing.sh OUT_DIR}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CORP=(python3 -c "from corp_deploy.launch import main; main()")  # the checkout's corp-deploy, installed or not
if [ "$DEVICE" = cpu ]; then
    MODEL=${MODEL:-deit_tiny} HALF=bf16 OPS_MODEL=deit_tiny_patch16_224 OPS_PRECISIONS=fp32
    MODEL_ARGS=${MODEL_ARGS:---model-arg img_size=32 --model-arg patch_size=8 --model-arg depth=2}
else
    nvidia-smi -L
    MODEL=${MODEL:-deit_base} HALF=fp16 OPS_MODEL=deit_base_patch16_224 OPS_PRECISIONS=fp16,fp32 MODEL_ARGS=${MODEL_ARGS:-}
fi
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)"
step() { echo "== $1 ($(date +%T))"; }
art="$OUT/art-$MODEL-s0.5"
BENCH=(--min-time 1 --warmup 3 --data-samples 8)

step "0 compress $MODEL at s = 0.5 on $DEVICE"
# shellcheck disable=SC2086  # MODEL_ARGS is a list of options
timeout 180 "${CORP[@]}" compress "$MODEL" --no-pretrained $MODEL_ARGS --s 0.5 --device "$DEVICE" --calib-samples 64 \
    -o "$art" 2>&1 | tail -3

step "1 eager PyTorch, $HALF and fp32, batch 1, 8, 64"
for precision in "$HALF" fp32; do
    timeout 120 "${CORP[@]}" bench "$art" --backends torch --torch-precision "$precision" --batch 1,8,64 "${BENCH[@]}" \
        --json "$OUT/bench_eager_$precision.json" --markdown "$OUT/bench_eager_$precision.md" 2>&1 | tail -12
done

step "2 standalone CUDA events, $HALF batch 64, against bench's device-resident figure"
timeout 120 python3 -m lab.studies.cuda_events "$art" --device "$DEVICE" --precision "$HALF" --batch 64 \
    --bench "$OUT/bench_eager_$HALF.json" --out "$OUT/cuda_events_${HALF}_b64.json"

if [ "$DEVICE" != cpu ]; then
    step "3 CUDA graphs, $HALF and fp32, batch 1, 8, 64"
    for precision in "$HALF" fp32; do
        timeout 120 "${CORP[@]}" bench "$art" --backends torch --cuda-graphs --torch-precision "$precision" --batch 1,8,64 \
            "${BENCH[@]}" --json "$OUT/bench_graphs_$precision.json" --markdown "$OUT/bench_graphs_$precision.md" \
            2>&1 | tail -12
    done
fi

step "4 torch-compile (inductor), $HALF, batch 1 and 64"
timeout 240 "${CORP[@]}" bench "$art" --backends torch-compile --torch-precision "$HALF" --batch 1,64 "${BENCH[@]}" \
    --json "$OUT/bench_compile_$HALF.json" --markdown "$OUT/bench_compile_$HALF.md" 2>&1 | tail -12

step "5 operators and kernels per forward, dense against compressed"
timeout 180 python3 -m lab.studies.ops_per_forward --model "$OPS_MODEL" --device "$DEVICE" \
    --precisions "$OPS_PRECISIONS" --batches 1 --variants s0.5 --min-time 0.5 --out "$OUT/ops_per_forward.json"
echo "done $(date +%T)"
