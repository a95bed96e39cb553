#!/usr/bin/env bash
# DomainConfig(cuda_graph=True) on one H200 (issue 16, item 2): the CUDA checks (graphed ==
# eager over 1-rank MD with list rebuilds, stress, recapture on edge overflow) and the
# small-system benchmark (bare / bare cuda_graph / wrapper / dm / dm cuda_graph, skin 0 and
# 0.5, at 1000 and 4096 atoms). Results go to $OUT. About 3 minutes, at most 5.5. Run from the
# repository root on the device machine after the project's usual device prefix:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/mace:$PWD/plugins/uma; bash benchmarks/gpu_small.sh
set -x
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_small_out}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
torch_version=$(python3 -c 'import torch; print(torch.__version__)')
machine="nvidia-h200 device machine (one $gpu), torch $torch_version, $(date -u +%Y-%m-%d)"
timeout 60 python3 -c "import torch, e3nn, mace, mlipdd, mlipdd_mace; print(torch.__version__, torch.cuda.is_available(), e3nn.__version__, mlipdd.__file__)" 2>&1 | tee "$OUT/versions.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py \
    plugins/mace/tests/test_cuda_graph_mace.py > "$OUT/cuda_graph_tests.txt" 2>&1
echo "pytest exit code: $?" | tee -a "$OUT/cuda_graph_tests.txt"
tail -40 "$OUT/cuda_graph_tests.txt"
timeout 210 python3 benchmarks/mace_small.py --sizes 1000,4096 --repeats 15 --profile \
    --machine "$machine" --name mace_small_gpu_cuda_graph > "$OUT/mace_small.txt" 2>&1
echo "benchmark exit code: $?" | tee -a "$OUT/mace_small.txt"
tail -25 "$OUT/mace_small.txt"
cp benchmarks/results/mace_small_gpu_cuda_graph.* "$OUT/" 2>/dev/null
ls -l "$OUT"
