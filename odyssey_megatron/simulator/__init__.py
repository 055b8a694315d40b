"""Event-driven cluster simulator: Odyssey against Oobleck, ReCycle and checkpoint-restart
on the same events, estimator and profile (paper 001, section V-B)."""
