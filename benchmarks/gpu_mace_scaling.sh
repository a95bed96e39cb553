#!/usr/bin/env bash
# Medium MACE on 2 H200s: NCCL conformance (halo and sharded storage), strong scaling at
# 27k atoms and weak scaling at 27k atoms per GPU, halo vs sharded. Run on nvidia-h200-x2
# with carry [".whl"] after:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/mace:$PWD/plugins/uma
# New rows are appended to benchmarks/results/multi_gpu_rows.jsonl; logs and rows go to $OUT.
set -x
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROWS=benchmarks/results/multi_gpu_rows.jsonl
before=$(wc -l < $ROWS)
run2() { timeout 240 torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu.py "$@"; }
run1() { CUDA_VISIBLE_DEVICES=0 timeout 200 torchrun --standalone --nproc_per_node 1 benchmarks/multi_gpu.py "$@"; }
{
  run2 conformance
  run1 time --atoms 27000 --tag strong
  run2 time --atoms 27000 --tag strong --strategy sharded
  run2 time --atoms 27000 --tag strong
  run2 time --atoms 54872 --tag weak --strategy sharded
  run2 time --atoms 54872 --tag weak
} 2>&1 | tee "$OUT/mace_scaling.log"
tail -n +$((before + 1)) $ROWS > "$OUT/new_rows.jsonl"
