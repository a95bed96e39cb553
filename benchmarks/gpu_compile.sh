#!/usr/bin/env bash
# DomainConfig(compile=True) on one H200 (issue 22): the CUDA tests of tests/test_compile.py
# (inductor: LJ float64 == eager to 1e-10, a small MACE float32 within 1e-4) and the
# benchmark eager vs compiled vs CUDA-graphed (medium MACE e3nn, float32, 1k and 4k atoms,
# force call and MD step). Results go to $OUT. Inductor's first compile of a medium MACE
# takes minutes, so one size per device command (10 minutes each): the first argument is
# the size (default 1000; the tests run with it), e.g. `bash benchmarks/gpu_compile.sh 4096`.
# Run from the repository root on the device machine after the project's usual prefix:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/mace; bash benchmarks/gpu_compile.sh 1000
set -x
SIZE=${1:-1000}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_compile_out}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache  # the tests' kernels are reused by the benchmark where shapes match
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
torch_version=$(python3 -c 'import torch; print(torch.__version__)')
machine="nvidia-h200 device machine (one $gpu), torch $torch_version, $(date -u +%Y-%m-%d)"
[ "$SIZE" = 1000 ] && [ -z "$SKIP_TESTS" ] && timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_compile.py -k cuda > "$OUT/compile_tests.txt" 2>&1
echo "pytest exit code: $?" | tee -a "$OUT/compile_tests.txt"
tail -30 "$OUT/compile_tests.txt"
timeout 400 python3 benchmarks/compile_gpu.py --sizes "$SIZE" --steps 200 --repeats 15 \
    --machine "$machine" --name "compile_gpu_$SIZE" > "$OUT/compile_gpu_$SIZE.txt" 2>&1
echo "benchmark exit code: $?" | tee -a "$OUT/compile_gpu_$SIZE.txt"
tail -25 "$OUT/compile_gpu_$SIZE.txt"
cp benchmarks/results/compile_gpu_"$SIZE".* "$OUT/" 2>/dev/null
ls -l "$OUT"
