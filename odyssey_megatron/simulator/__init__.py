"""Event-driven cluster simulator: Odyssey against Oobleck, ReCycle and checkpoint-restart
(paper 001, section V-B) and against replica drop, micro-batch redistribution, DP
scale-in and hot spares, on the same events, estimator and profile."""
