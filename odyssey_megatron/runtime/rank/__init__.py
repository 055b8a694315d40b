"""The rank side of the live runtime: what runs inside a worker process. ``plan_runner``
builds a rank's training under one plan generation from its published step program and
per-block training state; the step mechanics are Megatron's own 1F1B
(``megatron_1f1b``), the op-list executor (``executor``), staggered optimizer steps
(``staggered_step``) and their host snapshots (``retake_snapshot``); ``controller_link``
is the worker's tie to the controller. It meets the control side only through
``runtime.protocol``."""
