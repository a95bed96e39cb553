#!/usr/bin/env bash
# UMA-like eSCN-MD on the nvidia-h200-x2 device machine, one call: mlipdd's graph partition and
# fairchem's own graph parallelism, 1 vs 2 GPUs, step time, peak GiB per GPU, and the largest
# system of each (sizes stepped up until CUDA runs out of memory). About 4-5 minutes; every
# launch runs under `timeout`, so the whole script ends within ~6.5 minutes.
#
# Device command (kind nvidia-h200-x2, carry [".whl", ".whl-uma"]; the wheels are fairchem-core
# 2.24.0 and what it imports, see /work/shared/GPU.md; warp-lang is not needed):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-uma/*.whl && export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/mace:$PWD/plugins/uma && bash benchmarks/gpu_uma.sh
#
# Writes to $OUT (at most 8 files): uma_rows.jsonl (every row of every launch), uma_gpu.md
# (the table), env.txt, logs.tgz (each launch's log). Bring the rows home and run
#   python benchmarks/uma_gpu.py report uma_rows.jsonl --machine "..."
set -u
OUT=${OUT:-/tmp/uma_out}
mkdir -p "$OUT" /tmp/uma_logs
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # less fragmentation: the same for every path
# fairchem imports wandb at import time and never uses it for inference: a stand-in, outside the project
mkdir -p /tmp/standin/wandb && echo '"""stand-in: imported by fairchem, unused for inference"""' >/tmp/standin/wandb/__init__.py
export PYTHONPATH=/tmp/standin:${PYTHONPATH:-}
ROWS=$OUT/uma_rows.jsonl
LOGS=/tmp/uma_logs
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# a launch's exit status, as a row for the report (124: stopped by its timeout, sizes cut short)
launched() { echo "$1 exit $2" | tee -a $LOGS/exits.txt; echo "{\"task\": \"launch\", \"name\": \"$1\", \"exit\": $2}" >>"$ROWS"; }
TORCHRUN="python3 -m torch.distributed.run --standalone"  # torchrun itself may not be on PATH
# A launch stopped by its timeout may leave a rank holding GPU memory: end what this script
# started that still uses a GPU, by pid, before the next launch.
free_gpus() {
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    kill -9 "$pid" 2>/dev/null && echo "ended leftover rank $pid"
  done
  sleep 1
}

{
  nvidia-smi -L; python3 -V
  python3 - <<'PY'
import torch, e3nn, fairchem.core, mlipdd
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print("e3nn", e3nn.__version__, "fairchem", fairchem.core.__version__, "mlipdd from", mlipdd.__file__)
PY
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c "import fairchem.core, mlipdd_uma" 2>/dev/null || { echo "fairchem-core or mlipdd_uma does not import: see env.txt (wheels installed? PYTHONPATH?)"; exit 1; }

# Sizes: diamond-Si cubic cells per axis (8 atoms each), ascending; a launch ends at its first failure.
# 1 GPU: 11.8 GiB per 1k atoms measured before (96 GiB at 8000), so the wall is near 11.5k atoms.
ONE=${UMA_ONE:-10,10x10x11,10x11x11,11,11x11x12,11x12x12,12}
# 2 GPUs: graph partition held 48 GiB per GPU at 8000, so the wall is near 23k atoms.
TWO=${UMA_TWO:-10,12,13,13x13x14,13x14x14,14,14x14x15,14x15x15,15,15x15x16}
MOLE=${UMA_MOLE:-10}  # UMA-S-like 32-expert MoLE at 8000 atoms (CPU: no more memory than the dense model)

A2A=${UMA_A2A:-10}  # fairchem's all_to_all exchange, dense model
EXTRA=${UMA_ARGS:-}  # e.g. "--config tiny --repeats 1" for a CPU dry run of this script

# 1) one GPU each, side by side: mlipdd (one rank) on GPU 0, fairchem's plain model on GPU 1
stamp "1 GPU: mlipdd on GPU 0 | fairchem plain on GPU 1"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 110 python3 benchmarks/uma_gpu.py ladder --mole-sizes $MOLE --sizes $ONE $EXTRA \
  --rows $LOGS/rows_mlipdd_1.jsonl >$LOGS/mlipdd_1gpu.log 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout -k 10 110 python3 benchmarks/fairchem_gp.py --mole-sizes $MOLE --sizes $ONE $EXTRA \
  --rows $LOGS/rows_fairchem_1.jsonl >$LOGS/fairchem_1gpu.log 2>&1 &
B=$!
wait $A; EA=$?
wait $B; EB=$?
launched "mlipdd 1 GPU" $EA
launched "fairchem plain 1 GPU" $EB
cat $LOGS/rows_mlipdd_1.jsonl $LOGS/rows_fairchem_1.jsonl >>"$ROWS" 2>/dev/null
free_gpus

# 2) mlipdd graph partition, 2 GPUs
stamp "2 GPUs: mlipdd graph partition"
timeout -k 10 130 $TORCHRUN --nproc_per_node 2 benchmarks/uma_gpu.py ladder --mole-sizes $MOLE \
  --sizes $TWO $EXTRA --rows "$ROWS" >$LOGS/mlipdd_2gpu.log 2>&1
launched "mlipdd graph partition 2 GPUs" $?
free_gpus

# 3) fairchem's own graph parallelism, 2 GPUs: agreement check (one process, mlipdd, both modes),
#    all_to_all at 8000, then the all-gather ladder
stamp "2 GPUs: fairchem graph parallel"
timeout -k 10 140 $TORCHRUN --nproc_per_node 2 benchmarks/fairchem_gp.py --check --a2a-sizes $A2A \
  --mole-sizes $MOLE --sizes $TWO $EXTRA --rows "$ROWS" >$LOGS/fairchem_2gpu.log 2>&1
launched "fairchem graph parallel 2 GPUs" $?
free_gpus

stamp "report"
python3 benchmarks/uma_gpu.py report "$ROWS" --output "$OUT/uma_gpu.md" \
  --machine "nvidia-h200-x2 device machine ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x2), $(date -u +%F)" \
  >$LOGS/report.log 2>&1 || cat $LOGS/report.log
cat "$OUT/uma_gpu.md" 2>/dev/null
for f in $LOGS/*.log; do echo "== $f (tail)"; grep -v -E "Warning|warn|wait_tensor|before the output|^\s*$" "$f" | tail -n 4; done
tar -czf "$OUT/logs.tgz" -C /tmp uma_logs
stamp "done"
