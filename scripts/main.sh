#!/usr/bin/env bash
# Set up (if needed) and run the main job: the decision center on the paper's
# 32-NPU Llama-2 7B recipe, first after one failed rank, then after a lost node.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
recipe=recipes/llama2_7b/ascend_910b_32.yaml
.venv/bin/odyssey plan --config "$recipe" --failed 5
echo
.venv/bin/odyssey plan --config "$recipe" --failed-nodes 1
