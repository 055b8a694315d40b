"""Runtime: the live side of a job, in two process kinds that meet only through
``protocol`` (store keys per generation, JSON messages; the timeouts they wait by sit
below, in ``odyssey_megatron.timeouts``): ``rank/`` runs inside a worker (its plan runner
and step mechanics on Megatron-Core, its link to the controller), ``control/`` outlives
the workers (controller, node launcher, fault detector, run record)."""
