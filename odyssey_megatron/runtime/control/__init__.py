"""The control side of the live runtime: what outlives the workers. The controller
(store host, fault detector, plan publisher), the node launcher, the detector's rules,
the launch configuration in torchrun's names, and the run directory's live files. It
meets the worker side only through ``runtime.protocol``."""
