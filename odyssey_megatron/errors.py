"""The one error type for user mistakes: the ``odyssey`` command prints ``str()`` as one
line and exits 2. Anything else escaping a command is a bug and keeps its traceback."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A user error in a file, setting, flag or environment; ``str()`` is the one line to
    print: what (``key``: a config key, flag or file), what is wrong, what is allowed."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem
