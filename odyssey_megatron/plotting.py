"""matplotlib as the plugin uses it: plots written to files with the Agg backend.

matplotlib reads ``MPLBACKEND`` when it is imported and raises on a name it does not know,
which would end a finished simulation or training run in a traceback when its plots are
drawn; commands that plot call ``pyplot`` before their work, so a bad value is one line.
"""

from __future__ import annotations

import os
from typing import Any

from odyssey_megatron.errors import ConfigError

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; ConfigError naming MPLBACKEND if matplotlib refuses it."""
    try:
        import matplotlib
    except ValueError as exc:
        reason = str(exc).split(": ", 1)[-1].split(";")[0]
        raise ConfigError("MPLBACKEND", f"{reason}; unset it: odyssey writes its plots to files with the Agg "
                                        f"backend (got MPLBACKEND={os.environ.get('MPLBACKEND', '')!r})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
