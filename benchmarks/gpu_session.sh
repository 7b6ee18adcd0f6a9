#!/usr/bin/env bash
# One call on the GPU machine: environment, then the stages named as arguments
# (gpu-suite, gpu-suite-sm80, bias-sm90, mask, main, bench, bench-quick, masked, sharding, sanitize, sanitize-lazy, sanitize-seg,
# sanitize-sec, sanitize-hdims, stalls, ab, ...), each logged under $OUT.
# ab: AB="base new" times the builds .gl/ext_base.so.xz, .gl/ext_new.so.xz one after the other
# (jaxflash alone, D 64/128, S 4k/16k, both directions) and leaves the last one installed.
# Carry: .whl (flash-attn3-jax + einops wheels) and, to skip the build there, a prebuilt
# jaxflash/_jaxflash_ext.cpython-312-x86_64-linux-gnu.so (or .gl/ext.so.xz, the same xz-packed).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxflash-out}
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site
# A prebuilt extension may also travel xz-compressed (the carry limit is 64 MiB).
if [ -f .gl/ext.so.xz ] && ! ls jaxflash/_jaxflash_ext*.so >/dev/null 2>&1; then
  xz -dc .gl/ext.so.xz > jaxflash/_jaxflash_ext.cpython-312-x86_64-linux-gnu.so
fi
if ! ls jaxflash/_jaxflash_ext*.so >/dev/null 2>&1; then
  CMAKE_BUILD_PARALLEL_LEVEL=16 JAXFLASH_CUDA_ARCHS=90a \
    pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi

for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    smoke) for D in 64 128; do for c in "" --causal; do
          timeout 60 python3 benchmarks/profile_kernels.py --small --D $D $c --reps 1 || echo "SMOKE FAILED D=$D $c"
        done; done ;;
    # The whole GPU suite in 12 workers (compiling dominates: no GEMM autotuning, memory on
    # demand), the >2^31-element tests alone first; then the plain-attention tests again on the
    # sm80 kernels. Failures print as they happen. The flags stay in a subshell: a sweep after
    # it times every library with XLA's defaults.
    gpu-suite) ( export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
        timeout 200 python3 -m pytest -q -m gpu -rfE --timeout 150 -p no:cacheprovider \
          tests/test_gpu.py 2>&1 | tee "$OUT/gpu_suite.log" | tail -4
        timeout 480 python3 -m pytest -v -m gpu -rfE -n 12 --timeout 300 -p no:cacheprovider \
          --ignore tests/test_gpu.py tests 2>&1 | tee -a "$OUT/gpu_suite.log" \
          | grep -E "FAILED|ERROR|passed|failed" ) ;;
    gpu-suite-sm80) XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \
        JAXFLASH_DISABLE_SM90=1 timeout 300 python3 -m pytest -v -m gpu -rfE -n 12 --timeout 300 \
        -p no:cacheprovider tests/test_attention.py tests/test_transforms.py 2>&1 \
        | tee "$OUT/gpu_suite_sm80.log" | grep -E "FAILED|ERROR|passed|failed" ;;
    # the sm90 backward of a full bias: the bias tests, both sanitizers on the variant calls (the
    # first one's backward takes it), the bias case timed
    bias-sm90) ( export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0
        timeout 300 python3 -m pytest -v -m gpu -rfE -n 8 --timeout 200 -p no:cacheprovider \
          tests/test_variants.py -k bias 2>&1 | tee "$OUT/bias_sm90.log" | grep -E "FAILED|ERROR|passed|failed"
        for tool in memcheck racecheck; do
          timeout 120 compute-sanitizer --tool $tool --print-limit 20 python3 \
            benchmarks/profile_kernels.py --variants --D 128 --reps 1 2>&1 | tail -2 \
            | sed "s/^/$tool bias-sm90: /" | tee -a "$OUT/sanitize.log"; done
        timeout 200 python3 benchmarks/masked.py --cases bias --out "$OUT" --commit "$COMMIT" \
          --results "$OUT/RESULTS.md" --note "bias-sm90" 2>&1 | grep -v "masked \[" ) ;;
    # the dense mask's tile summary: block-sparse masks on every tile shape, and the other masks
    mask) timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_variants.py \
        -k "block_sparse or mask" 2>&1 | tee "$OUT/mask.log" | tail -25 ;;
    main) timeout 300 python3 -m jaxflash 2>&1 | tee "$OUT/main.log" | grep -v "\]" ;;
    bench-quick) timeout 300 python3 benchmarks/bench.py --dims 128 --seqlens 4096 --out "$OUT" \
        --commit "$COMMIT" --results "$OUT/RESULTS.md" 2>&1 | grep -v "^bench \[" ;;
    bench) timeout 580 python3 benchmarks/bench.py --out "$OUT" --commit "$COMMIT" \
        --results "$OUT/RESULTS.md" 2>&1 | grep -v "^bench \[" ;;
    masked) timeout 480 python3 benchmarks/masked.py --out "$OUT" --commit "$COMMIT" \
        --results "$OUT/RESULTS.md" --json "$OUT/masked.json" 2>&1 | tee "$OUT/masked.log" \
        | grep -v "masked \[" ;;
    # every visible GPU (a multi-GPU kind); the pytest process shares the GPUs with the
    # multiprocess test's workers, so memory is allocated on demand
    sharding) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python3 -m pytest -v -rs \
        -p no:cacheprovider tests/test_sharding.py tests/test_multiprocess.py 2>&1 \
        | tee "$OUT/sharding.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|Error|passed|failed" ;;
    profile) timeout 300 ncu --kernel-name regex:'flash_fwd|main_kernel' --launch-skip 2 \
        --launch-count 2 --set full -o "$OUT/prof" python3 benchmarks/profile_kernels.py >"$OUT/ncu.log" 2>&1
        ncu --import "$OUT/prof.ncu-rep" --page details > "$OUT/prof.txt" 2>&1
        grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Shared Memory Configuration Size|L1/TEX Hit|Bank|Warp Cycles Per Issued|Executed Ipc A" "$OUT/prof.txt" | head -40
        rm -f "$OUT/prof.ncu-rep" ;;
    # per-instruction stall sampling of the sm90 forward and backward (D=128, S=4k), summarised
    stalls) for k in fwd bwd; do
          timeout 150 ncu --kernel-name regex:flash_${k}_sm90 --launch-skip 1 --launch-count 1 \
            --section SourceCounters --section WarpStateStats -o "$OUT/src_$k" \
            python3 benchmarks/profile_kernels.py --D 128 --S 4096 >"$OUT/ncu_$k.log" 2>&1
          ncu --import "$OUT/src_$k.ncu-rep" --page source --csv --print-source sass >"$OUT/src_$k.csv"
          rm -f "$OUT/src_$k.ncu-rep"
          python3 benchmarks/stall_sites.py "$OUT/src_$k.csv" --top 12 | tee "$OUT/stalls_$k.txt"
        done ;;
    ab) for v in ${AB:?AB names the builds .gl/ext_NAME.so.xz to compare}; do
          xz -dc ".gl/ext_$v.so.xz" > jaxflash/_jaxflash_ext.cpython-312-x86_64-linux-gnu.so
          echo "--- $v"
          timeout 200 python3 benchmarks/bench.py --dims 64 128 --seqlens 4096 16384 --peers jaxflash \
            --out "$OUT/ab_$v" --commit "$v" --results "$OUT/ab_$v.md" 2>&1 | grep "|"
        done ;;
    sanitize) for tool in memcheck racecheck; do for D in 64 128 256; do for c in "" --causal; do
          timeout 120 compute-sanitizer --tool $tool --print-limit 20 python3 \
            benchmarks/profile_kernels.py --small --D $D $c --reps 1 2>&1 | tail -2 \
            | sed "s/^/$tool D=$D $c: /" | tee -a "$OUT/sanitize.log"; done; done; done ;;
    # the D=128 and D=256 forwards' lazy max over many key tiles, its rescale and S-recompute
    # paths taken
    sanitize-lazy) for tool in memcheck racecheck; do for D in 128 256; do for c in "" --causal; do
          timeout 150 compute-sanitizer --tool $tool --print-limit 20 python3 \
            benchmarks/profile_kernels.py --many-tiles --kv 700 --jump --D $D $c --reps 1 2>&1 \
            | tail -2 | sed "s/^/$tool lazy D=$D $c: /" | tee -a "$OUT/sanitize.log"; done; done; done ;;
    sanitize-seg) for tool in memcheck racecheck; do for D in 64 128; do for c in "" --causal; do
          timeout 120 compute-sanitizer --tool $tool --print-limit 20 python3 \
            benchmarks/profile_kernels.py --segments --D $D $c --reps 1 2>&1 | tail -2 \
            | sed "s/^/$tool segments D=$D $c: /" | tee -a "$OUT/sanitize.log"; done; done; done ;;
    # the causal backward's grid in sections of (b, kv head) pairs, the last one narrower (past
    # and within the first-store tickets' 2k keys). racecheck does not take mbarrier waits as
    # ordering: at D=256 it reports the sdQ slots' stores by both consumer warpgroups, which the
    # dQ writer's mbarriers order (NOTES.md, forty-ninth session).
    sanitize-sec) for tool in memcheck racecheck; do for D in 64 128 256; do for S in 2500 1500; do
          timeout 150 compute-sanitizer --tool $tool --print-limit 20 python3 \
            benchmarks/profile_kernels.py --sections $S --D $D --causal --reps 1 2>&1 | tail -2 \
            | sed "s/^/$tool sections S=$S D=$D: /" | tee -a "$OUT/sanitize.log"; done; done; done ;;
    sanitize-hdims) for DDv in "32 32" "96 96" "192 192" "256 256" "192 128" "128 64"; do
        read -r D Dv <<< "$DDv"; for tool in memcheck racecheck; do for c in "" --causal; do
          timeout 120 compute-sanitizer --tool $tool --print-limit 20 python3 \
            benchmarks/profile_kernels.py --small --D $D --Dv $Dv $c --reps 1 2>&1 | tail -2 \
            | sed "s/^/$tool D=$D Dv=$Dv $c: /" | tee -a "$OUT/sanitize.log"; done; done; done ;;
    ring) timeout 400 python3 benchmarks/ring_scaling.py --out "$OUT/ring_scaling" 2>&1 | tee "$OUT/ring.log"
        timeout 180 python3 benchmarks/ring_scaling.py --gpus 4 --tokens-per-gpu 262144 --warmup 1 \
          --iters 2 --out "$OUT/ring_1m" 2>&1 | tail -3 | tee -a "$OUT/ring.log" ;;
    flax) timeout 300 python3 examples/train_lm.py --benchmark --seq-len 8192 --batch-size 1 \
        --features 1024 --num-heads 8 --num-kv-heads 8 --num-layers 2 --dtype bfloat16 \
        --bench-steps 10 2>&1 | tee "$OUT/flax_bench.log" | grep -v "\]" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
