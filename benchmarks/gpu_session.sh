#!/usr/bin/env bash
# One call on a lent NVIDIA GPU machine: the GPU tests, then benchmarks/gpu.py.
#
#   bash benchmarks/gpu_session.sh [tests-args] -- [gpu.py args]
#
# Wheels under .whl/ (beartype, tokamax and its dependencies; see benchmarks/README.md)
# are installed into /tmp/site first. Results and logs go to $OUT (or
# benchmarks/results). TEST_TIMEOUT bounds the tests (seconds, default 150);
# TESTS=0 skips them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# (the tests on the GPU with XLA's usual optimisations: see conftest.py)
export FNATTN_TEST_XLA_OPT=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,temperature.gpu,power.draw --format=csv
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"

test_args=()
bench_args=()
seen=0
for a in "$@"; do
  if [ "$a" = "--" ]; then seen=1; continue; fi
  if [ $seen = 0 ]; then test_args+=("$a"); else bench_args+=("$a"); fi
done
if [ "${TESTS:-1}" != 0 ]; then
  start=$(date +%s)
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -k test_gpu_ \
    "${test_args[@]}" > "$OUT/gpu_tests.log" 2>&1
  echo "tests: exit $? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|error|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -25
fi
python3 benchmarks/gpu.py --out-dir "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/gpu_bench.log" \
  | grep -v "^W\|^I[0-9]\|Warning"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
