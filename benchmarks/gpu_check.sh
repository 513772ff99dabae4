#!/usr/bin/env bash
# One call on a lent GPU machine (CUDA image: python3 with jax[cuda13],
# torch, numba, optax, orbax, treescope; no registry): builds the extension
# with the CUDA handlers, runs the GPU tests, compute-sanitizer's memcheck
# over the hostile-buffer fuzz tests, and benchmarks/gpu.py. Logs go to
# $OUT (or ./gpu-out). Wheels missing from the image (penzai, ordered-set)
# travel in .whl/.
#
#   STEPS="build tests memcheck bench" BENCH_ARGS="--workloads 0,1" \
#     bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
STEPS=${STEPS:-build tests memcheck bench}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
  | tee -a "$OUT/summary.txt"
$PY -c "import jax, jaxlib, torch; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'torch', torch.__version__, jax.devices())" \
  2>&1 | tee -a "$OUT/summary.txt"

for step in $STEPS; do
  case $step in
    build)
      log build
      t0=$(date +%s)
      CMAKE_ARGS="-DPZSC_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 ${EXTRA_CMAKE:-}" \
        CMAKE_BUILD_PARALLEL_LEVEL=16 \
        $PY -m pip install -q --no-build-isolation --no-deps --no-index \
        -e . >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      log "built in $(( $(date +%s) - t0 )) s"
      $PY -c "import pz_sparsecore as p; print(p.backend_info())" 2>&1 \
        | tee -a "$OUT/summary.txt"
      ;;
    tests)
      log "tests/test_gpu.py"
      timeout ${TEST_TIMEOUT:-240} $PY -m pytest -p no:cacheprovider \
        -v -rfE --timeout=100 tests/test_gpu.py ${TEST_ARGS:-} \
        >"$OUT/tests.log" 2>&1
      echo "rc=$?" >>"$OUT/tests.log"
      grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/tests.log" | tail -40 | tee -a "$OUT/summary.txt"
      ;;
    memcheck)
      # The platform allocator gives every buffer its own allocation, so
      # memcheck sees an access past any buffer; if that crashes the
      # process (a known issue of some jaxlib releases), run again with
      # XLA's pool allocated on demand, and say which ran.
      K=${MEMCHECK_K:-fuzz or refused or random_buffers or nan or zero_acc}
      for alloc in platform bfc; do
        log "compute-sanitizer memcheck ($alloc allocator): -k '$K'"
        if [ $alloc = platform ]; then
          export XLA_PYTHON_CLIENT_ALLOCATOR=platform
        else
          unset XLA_PYTHON_CLIENT_ALLOCATOR
          export XLA_PYTHON_CLIENT_PREALLOCATE=false
        fi
        # XLA's CUDA graphs (command buffers) and autotuning off: fewer
        # moving parts under the sanitizer; only the Python process is
        # instrumented (not the compiler processes XLA starts).
        XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
        timeout ${MEMCHECK_TIMEOUT:-200} compute-sanitizer --tool memcheck \
          --target-processes application-only \
          --error-exitcode 7 --kernel-name kns=Pzsc \
          $PY -X faulthandler -m pytest -q -p no:cacheprovider \
          tests/test_gpu.py -k "$K" >"$OUT/memcheck_$alloc.log" 2>&1
        rc=$?
        echo "rc=$rc" >>"$OUT/memcheck_$alloc.log"
        grep -E "ERROR SUMMARY|Invalid|passed|failed|Fatal|rc=" \
          "$OUT/memcheck_$alloc.log" | tail -12 | tee -a "$OUT/summary.txt"
        [ $rc = 139 ] || break
      done
      unset XLA_PYTHON_CLIENT_ALLOCATOR XLA_PYTHON_CLIENT_PREALLOCATE
      ;;
    bench)
      log "benchmarks/gpu.py ${BENCH_ARGS:-}"
      timeout ${BENCH_TIMEOUT:-240} $PY benchmarks/gpu.py ${BENCH_ARGS:-} \
        >"$OUT/bench.log" 2>&1
      echo "rc=$?" >>"$OUT/bench.log"
      tail -45 "$OUT/bench.log" | tee -a "$OUT/summary.txt"
      ;;
  esac
done
log done
