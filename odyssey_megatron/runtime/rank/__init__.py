"""The rank side of the live runtime: what runs inside a worker process. ``worker`` trains
plan generation after plan generation; ``plan_runner`` builds a rank's training under one
generation from its published step program and per-block training state; the step
mechanics are Megatron's own 1F1B (``megatron_1f1b``), the op-list executor
(``executor``), staggered optimizer steps (``staggered_step``) and their host copies for a retake
(``retake_copy``); ``emulation`` paces them to a profile's device time;
``block_transfer`` moves blocks between survivors; ``fault_injection`` carries out the
recipe's faults; ``controller_link`` is the worker's tie to the controller. It meets the
control side only through ``runtime.protocol``."""
