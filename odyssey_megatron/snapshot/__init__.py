"""In-memory snapshots: sharded, kept per node, protected by parity across nodes (paper 004)."""
