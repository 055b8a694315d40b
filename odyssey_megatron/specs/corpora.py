"""Named training corpora: the offline default and WikiText, the paper's workload.

``None`` marks the corpus built on the machine (the standard library's docstrings); a
string is the WikiText configuration whose raw parquet files are looked for in a Hugging
Face hub cache (``odyssey_megatron.data.corpus``).
"""

from __future__ import annotations

from typing import Optional

PYTHON_DOCSTRINGS = "python-docstrings"

CORPUS_SPECS: dict[str, Optional[str]] = {
    PYTHON_DOCSTRINGS: None,
    "wikitext-2": "wikitext-2-raw-v1",
    "wikitext-103": "wikitext-103-raw-v1",
}
