#!/usr/bin/env bash
# The GPU check, as one command on a machine with PyTorch and Triton but no vLLM
# (the device tool's H200 image): the benchmark with vLLM's Triton kernels side by
# side, then the kernel tests with their inputs on the GPU.
#
#   benchmarks/gpu_check.sh prepare   # here: copy the vLLM kernel sources to carry
#   benchmarks/gpu_check.sh           # there, carrying .vllm_src; writes to $OUT
#   benchmarks/gpu_check.sh sweep     # there: the MLA and MoE sweeps
#   benchmarks/gpu_check.sh graphs    # there: decode steps in CUDA graphs vs eager
#   benchmarks/gpu_check.sh kda       # there: vLLM's K3 KDA ops vs our reference
#   benchmarks/gpu_check.sh questions # there: kda, then graphs, in one call (~8 min)
#
# `prepare` copies the vLLM files benchmarks/vllm_baselines.py reads (vLLM's own
# Triton kernels, run without importing vLLM) from this checkout's .venv-0.34 (else
# .venv) into .vllm_src/ (git-ignored), keeping vLLM's layout. The run puts this checkout and
# triton_kernels/ (the folder holding k3_triton_kernels) on PYTHONPATH (no pip
# install there), and writes the benchmark table and its JSON (saved after each
# section) and the test log to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "prepare" ]]; then
    # The newest tested vLLM's sources where its environment is built.
    venv=.venv-0.34
    [[ -x "$venv/bin/python" ]] || venv=.venv
    src=$("$venv/bin/python" -c \
        "import importlib.util; print(importlib.util.find_spec('vllm').submodule_search_locations[0])")
    files=$(PYTHONPATH=benchmarks "$venv/bin/python" -c \
        "from vllm_baselines import SOURCE_FILES; print(' '.join(SOURCE_FILES))")
    folders=$(PYTHONPATH=benchmarks "$venv/bin/python" -c \
        "from vllm_baselines import SOURCE_FOLDERS; print(' '.join(SOURCE_FOLDERS))")
    rm -rf .vllm_src
    optional=$(PYTHONPATH=benchmarks "$venv/bin/python" -c \
        "from vllm_baselines import OPTIONAL_SOURCE_FILES as f; print(' '.join(f))")
    for f in $files; do
        mkdir -p ".vllm_src/$(dirname "$f")"
        cp "$src/$f" ".vllm_src/$f"
    done
    for f in $optional; do
        [[ -f "$src/$f" ]] || continue
        mkdir -p ".vllm_src/$(dirname "$f")"
        cp "$src/$f" ".vllm_src/$f"
    done
    for d in $folders; do
        mkdir -p ".vllm_src/$d"
        cp "$src/$d"/*.py ".vllm_src/$d/"
    done
    echo "copied into .vllm_src from $src: $files $optional $folders"
    exit 0
fi

OUT="${OUT:-/tmp/k3-gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/triton_kernels:$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
[[ -d .vllm_src ]] && export VLLM_SRC="$PWD/.vllm_src"
PY="${PYTHON:-python3}"

"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"

if [[ "${1:-}" == "graphs" ]]; then
    # Both of vLLM's graph forms for K3, captured and replayed against eager
    # (benchmarks/graph_check.py; vLLM's breakable capture read from .vllm_src).
    timeout "${GRAPH_SECONDS:-420}" "$PY" benchmarks/graph_check.py --out "$OUT" 2>&1 \
        | tee "$OUT/graph_check.txt"
    exit "${PIPESTATUS[0]}"
fi

if [[ "${1:-}" == "questions" ]]; then
    # The two open questions in one device call (one machine start): what vLLM's
    # KDA ops compute, then both CUDA graph forms against eager.
    status=0
    timeout "${KDA_SECONDS:-150}" "$PY" benchmarks/kda_ops_check.py --out "$OUT" 2>&1 \
        | tee "$OUT/kda_ops_check.txt"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    timeout "${GRAPH_SECONDS:-330}" "$PY" benchmarks/graph_check.py --out "$OUT" 2>&1 \
        | tee "$OUT/graph_check.txt"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    exit "$status"
fi

if [[ "${1:-}" == "kda" ]]; then
    # What vLLM's in-tree K3 KDA ops compute and in which state layout
    # (benchmarks/kda_ops_check.py; the ops read from .vllm_src).
    timeout "${KDA_SECONDS:-300}" "$PY" benchmarks/kda_ops_check.py --out "$OUT" 2>&1 \
        | tee "$OUT/kda_ops_check.txt"
    exit "${PIPESTATUS[0]}"
fi

if [[ "${1:-}" == "sweep" ]]; then
    # The launch-configuration sweeps the defaults are set from (about 8 minutes),
    # and with SWEEP_TESTS=1 the MLA and MoE kernel tests on the GPU before them.
    tests=0
    if [[ "${SWEEP_TESTS:-0}" == 1 ]]; then
        timeout "${TEST_SECONDS:-150}" "$PY" -m pytest -q -p no:cacheprovider \
            tests/kernels/test_mla_decode.py tests/kernels/test_latent_moe.py 2>&1 \
            | tee "$OUT/kernel_tests.log"
        tests=$?
    fi
    timeout "${MLA_SECONDS:-210}" "$PY" benchmarks/sweep_mla.py 2>&1 | tee "$OUT/mla_sweep.txt"
    mla=$?
    timeout "${MOE_SECONDS:-300}" "$PY" benchmarks/sweep_moe_tiles.py 2>&1 \
        | tee "$OUT/moe_tiles.txt"
    moe=$?
    echo "kernel tests rc=$tests, MLA sweep rc=$mla, MoE sweep rc=$moe"
    exit $((tests || mla || moe))
fi
# The benchmark first (the figures are what this run is for), then the kernel tests
# on the GPU; each within its own time, inside the device tool's 600 s a command.
# The cross-compile test is left out: here the kernels compile and run for real,
# and this machine's Triton is not the one CI cross-compiles with.
timeout "${BENCH_SECONDS:-330}" "$PY" benchmarks/bench_kernels.py \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.md"
bench=$?
# TESTS: pytest arguments in place of the whole kernel suite.
timeout "${TEST_SECONDS:-200}" "$PY" -m pytest -q -p no:cacheprovider \
    ${TESTS:-tests/kernels} --ignore=tests/kernels/test_cross_compile.py \
    --ignore=tests/kernels/test_benchmark_scripts.py 2>&1 \
    | tee "$OUT/kernel_tests.log"
tests=$?
echo "benchmark rc=$bench, kernel tests rc=$tests"
exit $((bench || tests))
