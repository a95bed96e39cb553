#!/usr/bin/env bash
# One H200 lease of session 10 (issues 22, 23): stages run by the device tool, one per call,
# from the repository root, results under $OUT. Wheels travel in ignored .whl_* folders
# (named in the call's carry); each stage copies what it carries to /tmp/big and installs it.
#   bash benchmarks/gpu_h200_session.sh tests     # CUDA tests of the suite (e3nn; no cuEq kernels yet)
#   bash benchmarks/gpu_h200_session.sh cueq      # 1M chunked fused cuEq vs bare 64k; one-rank overhead; profiles
#   bash benchmarks/gpu_h200_session.sh compile   # 128k chunked profile; compiled/eager/graphed cuEq + e3nn at 4k
set -x
STAGE=$1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 MLIPDD_BENCH_STALL_S=${MLIPDD_BENCH_STALL_S:-400}
mkdir -p /tmp/big /tmp/site "$OUT"
for d in .whl_*; do [ -d "$d" ] && cp "$d"/* /tmp/big/; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/big/*.whl > /tmp/pip.txt 2>&1 || tail -5 /tmp/pip.txt
export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/mace:$PWD/plugins/aimnet2:$PWD/plugins/ewald_pme:$PWD/plugins/uma:$PWD/benchmarks
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
machine="nvidia-h200 device machine (one $gpu), torch $(python3 -c 'import torch; print(torch.__version__)'), $(date -u +%Y-%m-%d)"
T() { local limit=$1; shift; echo "== $(date -u +%T) $*"; timeout "$limit" "$@"; echo "== rc $? $(date -u +%T)"; }
case $STAGE in
tests)
    # pass/fail only, so the two run side by side (16 cores, one GPU)
    T 120 python3 -m pytest -q -p no:cacheprovider tests/test_compile.py -k cuda > "$OUT/compile_tests.txt" 2>&1 &
    T 250 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_graph.py \
        plugins/mace/tests/test_cuda_graph_mace.py tests/test_lj.py::test_cuda_equals_ase \
        tests/test_neighbors.py::test_cuda_list_equals_brute_force 2>&1 | tee "$OUT/cuda_tests.txt" | tail -40
    wait; tail -15 "$OUT/compile_tests.txt"
    ;;
cueq)
    python3 -c "import cuequivariance_ops_torch, cuequivariance_torch; print('cueq ok')"
    T 330 python3 benchmarks/mace_cueq.py chunked --sizes 1000000 --chunks 16384 --reference-atoms 64000 \
        --machine "$machine" --name mace_cueq_1M_h200 --out-dir "$OUT" 2>&1 | tail -30
    T 150 python3 benchmarks/mace_cueq.py overhead --sizes 4096,27000,64000 --machine "$machine" \
        --name mace_cueq_h200 --out-dir "$OUT" 2>&1 | tail -12
    T 100 python3 benchmarks/mace_cueq_profile.py --atoms 64000 --kinds bare,mlipdd --machine "$machine" \
        --out-dir "$OUT" --name mace_cueq_profile_h200 2>&1 | grep -v "^|" | tail -8
    ;;
compile)
    T 90 python3 benchmarks/mace_cueq_profile.py --atoms 131072 --kinds chunked --chunk-atoms 16384 \
        --machine "$machine" --out-dir "$OUT" --name mace_cueq_profile_h200 2>&1 | grep -v "^|" | tail -5
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    T 250 python3 benchmarks/compile_gpu.py --cueq --sizes 4096 --steps 100 --repeats 10 --machine "$machine" \
        --name compile_gpu_cueq_4096_h200 2>&1 | tail -12
    cp benchmarks/results/compile_gpu_*_h200.* "$OUT/" 2>/dev/null
    ;;
compile_e3nn)
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    T 250 python3 benchmarks/compile_gpu.py --sizes 4096 --steps 100 --repeats 10 --machine "$machine" \
        --name compile_gpu_e3nn_4096_h200 2>&1 | tail -12
    cp benchmarks/results/compile_gpu_*_h200.* "$OUT/" 2>/dev/null
    ;;
esac
ls -l "$OUT"
