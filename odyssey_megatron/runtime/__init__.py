"""Runtime: one rank's training under an ExecutionPlan (``plan_runner`` and its step
mechanics), and the live runtime's two process kinds, apart: ``rank/`` runs inside a
worker, ``control/`` outlives workers (launcher, controller, fault detector), and they
share only ``protocol`` (store keys, JSON messages, timeouts)."""
