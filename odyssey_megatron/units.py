"""Units the package converts with in more than one place."""

GIB = 1024**3
"""Bytes per GiB."""
SECONDS_PER_HOUR = 3600.0
