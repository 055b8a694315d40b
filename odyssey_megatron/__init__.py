"""odyssey-megatron: backup-free fault tolerance for Megatron-Core pretraining.

The decision center (``decision_center`` over ``planner``, ``estimator``, ``restorer``)
with the op lists and step programs it publishes (``schedules``), and the ``simulator``,
are pure Python and never import torch (a test checks it); ``hooks`` is where
Megatron-Core lives (stage models, groups, gradient sync, per-block training state), and
``runtime`` is the live job: the rank side inside each worker, the control side around
them; ``report`` reads a run directory back into plots and a text summary.
"""

import warnings

__version__ = "0.1.0"

# Megatron-Core warns at import that Transformer Engine and Apex are missing and that it
# falls back to torch's kernels, which is how the plugin runs on CPUs and plain GPUs: a dozen
# lines above every answer, saying nothing the user can act on.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning)
