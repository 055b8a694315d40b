"""Scaffolding for tests and CPU benchmarks, not part of a training run: local gloo worlds
of spawned ranks (``local_world``)."""
