#!/usr/bin/env bash
# The GPU checks this project still owes, in priority order, one stage per device call.
#
# A session lent a GPU (device tool: 30 minutes in all, 10 per call) runs, from the repository root:
#
#   # once, on the CPU machine: the two pure-Python packages the GPU image lacks
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       dp-accounting==0.6.0 ml-collections==1.1.0
#   # then one device call per stage, carry=[".whl"]:
#   bash benchmarks/gpu_session.sh check          # kernels + DP paths equal their references ON THE GPU
#   bash benchmarks/gpu_session.sh long_context   # LongShield target: with remat, DP's max context = non-DP's
#   bash benchmarks/gpu_session.sh two_pass       # the same sweep with dp_method=two_pass
# (Predicted by XLA:GPU's compile for an H100 without one, WORKSPACE.md: remat full, non-DP and two-pass
# 32,256 tokens, book-keeping 29,696; remat none 13,824 for all. The GPU run adds tokens/s and checks
# that the allocator fits what the compiler assigned.)
#   bash benchmarks/gpu_session.sh kernels        # kernel times vs the non-DP weight gradient
#
# Each stage prints its table last and writes JSON and logs under $OUT; copy the numbers, with the
# device, JAX version and date the stage prints first, into WORKSPACE.md / benchmarks/RESULTS.md.
# DRY=1 prints the commands instead of running them.
set -uo pipefail

OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.96  # the long-context budget (76 GiB) assumes it; JAX's default is 0.75
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}  # the repository without an install

run() {  # run <seconds> <log name> <command...>: stops inside the device's 600 s per call
  local limit=$1 name=$2
  shift 2
  if [[ -n "${DRY:-}" ]]; then echo "timeout $limit $*"; return 0; fi
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
}

header() {
  [[ -n "${DRY:-}" ]] && return 0
  date -u +"date %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
}

# GPT-2 small on one 80 GB GPU: lengths from 4096 (fits without remat on XLA:CPU's estimate) in 1024 steps.
LONG_CONTEXT=(python3 -m experiments.long_context --models=gpt2-small --remat=none,full
              --memory_budget_gb=76 --min_seq_len=4096 --granularity=1024 --steps=3)

case "${1:-}" in
  check)
    header
    # Triton kernels vs plain-jnp references; fused_clip with strategy="pallas" vs vmap DP-SGD; two-pass.
    run 540 check python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_pallas_kernels.py tests/test_pallas_fused_clip.py tests/test_two_pass.py
    ;;
  long_context)
    header
    run 560 long_context "${LONG_CONTEXT[@]}" --out="$OUT/long_context.json"
    ;;
  two_pass)
    header
    run 560 long_context_two_pass "${LONG_CONTEXT[@]}" --dp_method=two_pass --out="$OUT/long_context_two_pass.json"
    ;;
  kernels)
    header
    run 560 kernels python3 -m experiments.bench_kernels --models=gpt2-small,llama-1b --seq_lens=1024,4096 \
      --batch_sizes=1,8 --out="$OUT/bench_kernels.json"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh check|long_context|two_pass|kernels" >&2
    exit 2
    ;;
esac
