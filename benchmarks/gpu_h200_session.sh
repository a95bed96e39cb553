#!/usr/bin/env bash
# H200 leases of sessions 10 and 11 (issues 22, 23, 26): stages run by the device tool, one per
# call, from the repository root, results under $OUT. Wheels travel in ignored .whl_* folders
# (named in the call's carry); each stage copies what it carries to /tmp/big and installs the
# wheels among it (the machine keeps /tmp while warm, so calls made back to back add up).
#   bash benchmarks/gpu_h200_session.sh tests     # CUDA tests of the suite (e3nn; no cuEq kernels yet)
#   bash benchmarks/gpu_h200_session.sh cueq      # 1M chunked fused cuEq vs bare 64k; one-rank overhead; profiles
#   bash benchmarks/gpu_h200_session.sh compile   # 128k chunked profile; compiled/eager/graphed cuEq at 4k
#   bash benchmarks/gpu_h200_session.sh compile_e3nn  # the same for e3nn
#   bash benchmarks/gpu_h200_session.sh d3        # D3 at 10k/100k (benchmarks/d3_memory.py; no Warp needed)
#   bash benchmarks/gpu_h200_session.sh d3_1M     # D3 at 1M
#   bash benchmarks/gpu_h200_session.sh longrange # PME 1M: 1 process, distributed mesh 1/2 gloo ranks, torch-pme; AIMNet2
# Session 14: s14_a then s14_b, back to back. Session 15: s15_a .. s15_e, back to back (carry in each).
# Session 11: four calls back to back (s11_a .. s11_d; carry in the comment of each). Their results
# go to /tmp/res and come back as one $OUT/results_<stage>.tgz, re-packed after every row, since
# at most 8 files come back from $OUT.
set -x
STAGE=$1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 MLIPDD_BENCH_STALL_S=${MLIPDD_BENCH_STALL_S:-400}
mkdir -p /tmp/big /tmp/site "$OUT"
shopt -s nullglob  # a carried folder without wheels (a part of warp's) adds none
wheels=()
for f in .whl_*/*; do  # a file already in /tmp/big came (and was installed) in an earlier call
    b=$(basename "$f"); [ -e "/tmp/big/$b" ] && continue
    cp "$f" /tmp/big/ && case $b in *.whl) wheels+=("/tmp/big/$b") ;; esac
done
[ ${#wheels[@]} -gt 0 ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ${wheels[@]} > /tmp/pip.txt 2>&1 || tail -5 /tmp/pip.txt; }
export PYTHONPATH=/tmp/site:$PWD/core:$PWD/plugins/mace:$PWD/plugins/aimnet2:$PWD/plugins/ewald_pme:$PWD/plugins/uma:$PWD/benchmarks
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
machine="nvidia-h200 device machine (one $gpu), torch $(python3 -c 'import torch; print(torch.__version__)'), $(date -u +%Y-%m-%d)"
T() { local limit=$1; shift; echo "== $(date -u +%T) $*"; timeout "$limit" "$@"; echo "== rc $? $(date -u +%T)"; }
RES=/tmp/res/$STAGE
mkdir -p "$RES"
S() { T "$@" 2>&1 | tee -a "$RES/log.txt" | tail -25; cp benchmarks/results/compile_gpu_*_h200.* "$RES/" 2>/dev/null
      tar czf "$OUT/results_$STAGE.tgz" -C "$RES" .; }  # one row, its log, then the pack that comes back
warp_whole() {  # warp's three parts (s11_b, s11_c, s11_d) joined, checked and installed
    cat /tmp/big/warp.part_* > /tmp/big/warp_lang-1.19.0-py3-none-manylinux_2_28_x86_64.whl
    (cd /tmp/big && sha256sum -c warp.sha256) && python3 -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/site /tmp/big/warp_lang-*.whl && python3 -c "import warp; warp.init()" 2>&1 | tail -2
}
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
d3)  # batch 2, call 1 of 3 (warp part 1 travels): h4's D3 chunking, 10k and 100k atoms (no Warp needed)
    T 300 python3 benchmarks/d3_memory.py --device cuda --reps 11,23 --chunks 0,524288 --dtype float32 \
        --out "$OUT" --name d3_memory_h200_small 2>&1 | tail -8
    ;;
d3_1M)  # call 2 of 3 (warp part 2): D3 at 1M atoms, chunked, then all edges at once (out of memory before)
    T 400 python3 benchmarks/d3_memory.py --device cuda --reps 50 --chunks 524288,0 --dtype float32 \
        --out "$OUT" --name d3_memory_h200_1M 2>&1 | tail -8
    ;;
longrange)  # call 3 of 3 (warp part 3): the warp wheel whole again, then PME at 1M and AIMNet2
    cat /tmp/big/warp.part_* > /tmp/big/warp_lang-1.19.0-py3-none-manylinux_2_28_x86_64.whl
    (cd /tmp/big && sha256sum -c warp.sha256)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/big/warp_lang-*.whl
    python3 -c "import warp; warp.init(); print('warp cuda devices', warp.get_cuda_device_count())"
    T 330 python3 benchmarks/pme_gpu.py --sizes 1000000 --rows pme,pme_dist_1,pme_dist_2,torchpme \
        --row-timeout 120 --machine "$machine" --name pme_gpu_1M_h200 --out-dir "$OUT" 2>&1 | tail -8
    T 200 python3 benchmarks/aimnet2_vs_calculator.py --device cuda --sizes 300,1000,3000,10000 --repeats 3 \
        --label "$machine." --name aimnet2_vs_calculator_h200 --out "$OUT" 2>&1 | tail -22
    ;;
s11_a)  # carry .whl_cueq_ops .whl_mace .whl_aimnet: NCCL capture at one rank, distributed PME with rank stacks, D3 97k
    S 90 python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/nccl_capture_probe.py --out "$RES"
    PME_GPU_STACKS=$RES PME_GPU_STACK_EVERY=15 S 260 python3 benchmarks/pme_gpu.py --sizes 10000,100000 \
        --rows pme_dist_1 --row-timeout 90 --machine "$machine" --name pme_gpu_dist_h200 --out-dir "$RES"
    S 170 python3 benchmarks/d3_memory.py --device cuda --reps 23 --chunks 524288,0 --dtype float32 \
        --out "$RES" --name d3_memory_h200_97k
    ;;
s11_b)  # carry .whl_cueq .whl_warp1: one-rank cuEq overhead after bc903be and its 64k profile; compiled cuEq 1k
    S 170 python3 benchmarks/mace_cueq.py overhead --sizes 4096,27000,64000 --machine "$machine" \
        --name mace_cueq_session11_h200 --out-dir "$RES"
    S 100 python3 benchmarks/mace_cueq_profile.py --atoms 64000 --kinds bare,mlipdd --machine "$machine" \
        --out-dir "$RES" --name mace_cueq_profile_session11_h200
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    S 190 python3 benchmarks/compile_gpu.py --cueq --sizes 1000 --steps 200 --repeats 15 --machine "$machine" \
        --name compile_gpu_cueq_1000_h200
    ;;
s11_c)  # carry .whl_warp2: compiled cuEq 27k, D3 1M
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    S 230 python3 benchmarks/compile_gpu.py --cueq --sizes 27000 --steps 200 --repeats 15 --machine "$machine" \
        --name compile_gpu_cueq_27000_h200
    S 200 python3 benchmarks/d3_memory.py --device cuda --reps 50 --chunks 524288,0 --dtype float32 \
        --out "$RES" --name d3_memory_h200_1M
    ;;
s11_d)  # carry .whl_warp3: warp whole; AIMNet2 vs aimnet's calculator; aten dispatch cost at 27k
    warp_whole
    S 230 python3 benchmarks/aimnet2_vs_calculator.py --device cuda --threads 16 --repeats 5 \
        --label "$machine." --name aimnet2_vs_calculator_h200 --out "$RES"
    S 150 python3 benchmarks/dispatch_cost_aten.py --device cuda --atoms 27000 --models lj,mace --ranks 2 \
        --rank-models lj,mace --repeats 7 --out "$RES" --name dispatch_cost_aten_h200
    ;;
s11_e)  # carry .whl_mace .whl_tad (a fresh machine, no nvalchemiops or warp: PME on its torch splines): D3 97k, 1M; PME on the GPU
    S 150 python3 benchmarks/d3_memory.py --device cuda --reps 23 --chunks 524288,0 --dtype float32 \
        --out "$RES" --name d3_memory_h200_97k
    S 200 python3 benchmarks/d3_memory.py --device cuda --reps 50 --chunks 524288,0 --dtype float32 \
        --out "$RES" --name d3_memory_h200_1M
    PME_GPU_STACKS=$RES S 200 python3 benchmarks/pme_gpu.py --sizes 100000,1000000 --rows pme_dist_1 \
        --row-timeout 60 --machine "$machine" --name pme_gpu_dist_h200 --out-dir "$RES"
    ;;
s14_a)  # carry .whl_a (cuEq's ops + mace stack + pytest): MACE 27k aten vs torch-function (issue 21 item 2); CUDA tests
    S 330 python3 benchmarks/dispatch_cost_aten.py --device cuda --atoms 27000 --models mace --ranks 2 \
        --rank-models lj --repeats 5 --out "$RES" --name dispatch_cost_aten_mace_27k_h200
    S 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py tests/test_cuda_graph.py \
        plugins/mace/tests/test_cuda_graph_mace.py tests/test_lj.py::test_cuda_equals_ase
    ;;
s14_a2)  # carry .whl_a (a fresh machine): the CUDA tests (forkserver with NVML's device count)
    S 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_graph.py \
        plugins/mace/tests/test_cuda_graph_mace.py tests/test_lj.py::test_cuda_equals_ase
    ;;
s14_c)  # carry .whl_a (a fresh machine): compiled force calls on CUDA (issue 22)
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    S 240 python3 -m pytest -q -p no:cacheprovider tests/test_compile.py -k cuda
    ;;
s14_d)  # carry .whl_b, right after s14_c: cuEq under DD on the GPU with the aten adapters (issue 23 item 1)
    S 300 python3 benchmarks/cueq_dd_gpu.py --ranks 2,3 --out "$RES" --name cueq_dd_gpu_h200
    S 200 python3 benchmarks/mace_cueq.py overhead --sizes 4096,27000 --machine "$machine" \
        --name mace_cueq_session14b_h200 --out-dir "$RES"
    ;;
s14_e)  # carry .whl_b, right after s14_a2, on main with the old dispatch deleted: cuEq under DD on the GPU again
    S 300 python3 benchmarks/cueq_dd_gpu.py --ranks 2,3 --out "$RES" --name cueq_dd_gpu_after_deletion_h200
    ;;
s14_b)  # carry .whl_b (cuEq torch ops): one-rank cuEq overhead (issue 23 item 2); cuEq under DD on the GPU
    S 200 python3 benchmarks/mace_cueq.py overhead --sizes 4096,27000,64000 --machine "$machine" \
        --name mace_cueq_session14_h200 --out-dir "$RES"
    S 240 python3 benchmarks/cueq_dd_gpu.py --ranks 2,3 --out "$RES" --name cueq_dd_gpu_session14_h200
    ;;
s15_a)  # carry .whl_a (a fresh machine): the CUDA tests and compiled CUDA force calls
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    S 330 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_graph.py \
        plugins/mace/tests/test_cuda_graph_mace.py tests/test_lj.py::test_cuda_equals_ase tests/test_compile.py -k cuda
    ;;
s15_b)  # carry .whl_b, right after s15_a: one-rank cuEq overhead interleaved call by call (issue 23 item 2); cuEq DD
    S 300 python3 benchmarks/mace_cueq.py overhead --sizes 4096,27000,64000 --repeats 40 --machine "$machine" \
        --name mace_cueq_session15_h200 --out-dir "$RES"
    S 200 python3 benchmarks/cueq_dd_gpu.py --ranks 2,3 --out "$RES" --name cueq_dd_gpu_session15_h200
    ;;
s15_c)  # carry .whl_w1 (warp part 1, aimnet, nvalchemiops): chunked cuEq under DD on the GPU's kernels
    S 300 python3 benchmarks/cueq_dd_gpu.py --ranks 2,3 --chunk-atoms 8 --out "$RES" --name cueq_dd_gpu_chunked_h200
    ;;
s15_d)  # carry .whl_w2: where a 4k cuEq call's host time goes, bare and mlipdd
    S 200 python3 benchmarks/mace_cueq_profile.py --atoms 4096 --kinds bare,mlipdd --machine "$machine" \
        --out-dir "$RES" --name mace_cueq_profile_session15_h200
    ;;
s15_e)  # carry .whl_w3: warp whole; AIMNet2 vs aimnet's calculator on the GPU (issue 26 item 8), medians; profile
    warp_whole
    S 330 python3 benchmarks/aimnet2_vs_calculator.py --device cuda --threads 16 --repeats 15 \
        --label "$machine." --name aimnet2_vs_calculator_session15_h200 --out "$RES"
    S 120 python3 benchmarks/aimnet2_vs_calculator.py --device cuda --threads 16 --profile 1000 \
        --kinds molecules,molecule --top 12 --label "$machine." --name aimnet2_profile_session15_h200 --out "$RES"
    ;;
s15_g)  # carry .whl_b, right after s15_a: cuEq under DD on the GPU, plain and chunked, on main after the merges
    S 200 python3 benchmarks/cueq_dd_gpu.py --ranks 2,3 --out "$RES" --name cueq_dd_gpu_session15_final_h200
    S 200 python3 benchmarks/cueq_dd_gpu.py --ranks 2 --chunk-atoms 8 --out "$RES" --name cueq_dd_gpu_chunked_final_h200
    ;;
s16_e)  # carry .whl_w3 after s15_carry with .whl_w1, .whl_w2: AIMNet2 vs aimnet's calculator after bb9dac5/90e4955
    warp_whole
    S 330 python3 benchmarks/aimnet2_vs_calculator.py --device cuda --threads 16 --repeats 15 \
        --label "$machine." --name aimnet2_vs_calculator_session16_h200 --out "$RES"
    S 120 python3 benchmarks/aimnet2_vs_calculator.py --device cuda --threads 16 --profile 1000 \
        --kinds molecules,crystal --top 14 --label "$machine." --name aimnet2_profile_session16_h200 --out "$RES"
    ;;
s15_carry)  # carry .whl_w1 then .whl_w2: only copied (and the wheels installed) for a later stage
    ;;
esac
ls -l "$OUT"
