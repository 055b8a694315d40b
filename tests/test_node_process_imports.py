"""A node's own process (its launcher; on node 0 also the controller, the run's owner and
the final model's merge) forks its workers from the fork server and leaves the data to a
child of it, so it never imports Megatron-Core, transformers or datasets itself. Measured
on the tiny recipe: about five seconds of one core less on every start of every node, and
none of the controller's polling thread stalled behind those imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NODE_MODULES = ("odyssey_megatron.cli", "odyssey_megatron.runtime.train", "odyssey_megatron.runtime.final_model",
                "odyssey_megatron.runtime.data_preparation", "odyssey_megatron.runtime.rank.entry",
                "odyssey_megatron.runtime.control.training_run", "odyssey_megatron.report")
HEAVY = ("megatron", "transformers", "datasets", "tokenizers")


def test_the_modules_a_node_s_own_process_runs_import_no_megatron_core_nor_the_data_libraries():
    probe = (f"import importlib, sys\nfor name in {NODE_MODULES!r}: importlib.import_module(name)\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
