"""Node 0 prepares the data in a child forked from the workers' fork server
(``runtime.data_preparation``): what the child meets comes back to the node's process as
it would have been raised there, and a stop does not wait for a corpus to be tokenized."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from odyssey_megatron.config import load_config
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.runtime.data_preparation import prepare_apart

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llama2_7b" / "tiny_cpu.yaml"

pytestmark = pytest.mark.timeout(180)


def _config(tmp_path: Path, corpus: Path):
    return load_config(RECIPE, [f"data.corpus={corpus}", f"data.cache_dir={tmp_path / 'cache'}"])


def test_a_cache_others_may_write_is_the_one_line_error_the_child_met(tmp_path):
    corpus = tmp_path / "notes.txt"
    corpus.write_text("a document long enough to be tokenized, and then some more words\n" * 200)
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache").chmod(0o777)
    with pytest.raises(ConfigError, match="is writable by group or others") as error:
        prepare_apart(_config(tmp_path, corpus), run_dir=tmp_path / "run", stopped=lambda: False, poll_s=0.05)
    assert "\n" not in str(error.value)


def test_a_stop_while_the_data_is_prepared_ends_the_child_without_waiting_for_it(tmp_path):
    corpus = tmp_path / "notes.txt"
    corpus.write_text("a document long enough to be tokenized\n" * 2000)
    started = time.monotonic()
    # Asked before the child can have answered (it imports the datasets library first).
    prepared = prepare_apart(_config(tmp_path, corpus), run_dir=tmp_path / "run", stopped=lambda: True, poll_s=0)
    assert prepared is None
    assert time.monotonic() - started < 30  # the child was killed, not waited for
    assert not (tmp_path / "cache" / "indexed").exists()  # it never got as far as writing the corpus
