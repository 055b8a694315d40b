#!/usr/bin/env bash
# Set up (if needed) and run the main job: the tiny Llama-2 recipe on 8 CPU ranks laid out
# as 4 pipelines of 2 stages, with a rank killed in step 5 and two in step 10 (Eq. 8
# reroutes their micro-batches to data-parallel peers, the cheaper transition) and one
# hung in step 15 (found from its missed heartbeats and killed by its launcher). Each dead
# worker is started again by its launcher (odyssey.restart_workers=1) and joins back: the
# plan grows onto it at the next step boundary. Prints the recovery and join summary, the
# plots of `odyssey report` and the offline W&B run's directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/odyssey train --config recipes/llama2_7b/tiny_cpu.yaml odyssey.restart_workers=1 \
    parallel.pipeline_model_parallel_size=2 parallel.data_parallel_size=4 \
    'odyssey.faults=[{rank: 5, step: 5, phase: backward, action: kill}, {rank: 2, step: 10, phase: forward, action: kill}, {rank: 6, step: 10, phase: forward, action: kill}, {rank: 1, step: 15, phase: forward, action: stop}]'
