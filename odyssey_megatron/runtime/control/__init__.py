"""The control side of the live runtime: what outlives the workers. The controller
(store host, fault detector, plan publisher), the run's owner on node 0
(``training_run``, its state and its jobs: ``run_state``, ``recovery``, ``growing_back``,
``snapshot_following``, ``stop_writer``), the node launcher, the
detector's rules, the launch configuration in torchrun's names, the run directory's live
files, its summary and its W&B trace. It meets the worker side only through
``runtime.protocol``; ``runtime.train`` joins the two for ``odyssey train``."""
