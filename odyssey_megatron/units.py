"""Units the package converts with in more than one place."""

GIB = 1024**3
"""Bytes per GiB."""
MIB = 1024**2
"""Bytes per MiB."""
SECONDS_PER_HOUR = 3600.0
