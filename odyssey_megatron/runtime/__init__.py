"""Runtime: one rank's training under an ExecutionPlan (and, next, the fault-tolerant launcher)."""
