"""The data path: local text -> datasets -> a real tokenizer -> Megatron's IndexedDataset and
GPTDataset -> micro-batches addressed by (step, micro-batch id).

Invariants: micro-batch m of step s holds exactly the samples (s * M + m) * b onwards, a
run's steps consume every prepared sample once, every process reading a sample gets the
same tokens, and the tokens are the text's own (documents packed between EOD tokens).
"""

from __future__ import annotations

import os
import pickle
import stat
import sysconfig
from pathlib import Path

import datasets
import pytest
import torch

from odyssey_megatron.data import IndexedTokens, PreparedData, prepare_data
from odyssey_megatron.data.corpus import load_corpus
from odyssey_megatron.data.tokenizer import load_megatron_tokenizer, load_tokenizer, prepare_tokenizer
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.testing.local_world import run_world

pytestmark = pytest.mark.timeout(300)

LINES = [
    "The survivors keep their in-memory state and a decision center picks the next execution plan.",
    "Rerouting sends the failed stage's micro-batches to its data-parallel peers; no weights move.",
    "Reparallelizing regroups the survivors into possibly asymmetric pipelines with uneven layer splits.",
    "The choice maximises post-recovery throughput times the share of time left after the transition.",
    "A step is committed when every rank of the current generation has finished its optimizer step.",
    "Whatever ran past the last committed step is rolled back and replayed on the new plan.",
    "Gloo closes its sockets only when the last Python reference to a process group is gone.",
    "Weights move with a minimum-cost plan computed by the Kuhn-Munkres algorithm over survivors.",
] * 3
MICRO_BATCH_SIZE, NUM_MICRO_BATCHES, STEPS = 2, 3, 4
SEQ_LENGTH = 16


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PreparedData:
    root = tmp_path_factory.mktemp("data")
    corpus = root / "notes.txt"
    corpus.write_text("\n".join(LINES[:8]) + "\n\n" + "\n".join(LINES[8:]) + "\n")
    return prepare_data(corpus=str(corpus), tokenizer=None, vocab_size=320, seq_length=SEQ_LENGTH,
                        num_samples=STEPS * NUM_MICRO_BATCHES * MICRO_BATCH_SIZE, seed=5, cache_dir=root / "cache")


def _read(rank: int, world_size: int, prepared_json: str, wanted: list[tuple[int, int]]) -> dict:
    source = IndexedTokens(PreparedData.from_json(prepared_json), micro_batch_size=MICRO_BATCH_SIZE,
                           num_micro_batches=NUM_MICRO_BATCHES)
    return {f"{step}/{m}": source.micro_batch(step, m)["tokens"] for step, m in wanted}


def test_micro_batches_hold_exact_sample_ids_and_each_sample_once(prepared):
    source = IndexedTokens(prepared, micro_batch_size=MICRO_BATCH_SIZE, num_micro_batches=NUM_MICRO_BATCHES)
    assert source.sample_ids(2, 1) == [14, 15]
    seen = []
    for step in range(STEPS):
        for m in range(NUM_MICRO_BATCHES):
            batch = source.micro_batch(step, m)
            assert batch["sample_ids"].tolist() == source.sample_ids(step, m)
            for row, sample in enumerate(source.sample_ids(step, m)):
                assert torch.equal(batch["tokens"][row], source.dataset[sample]["tokens"])  # GPTDataset's sample
            assert batch["tokens"].shape == batch["labels"].shape == (MICRO_BATCH_SIZE, SEQ_LENGTH)
            assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
            seen += batch["sample_ids"].tolist()
    assert sorted(seen) == list(range(prepared.num_samples))
    with pytest.raises(IndexError, match=f"prepared for {prepared.num_samples} \\({STEPS} steps\\)"):
        source.micro_batch(STEPS, 0)


def test_every_reader_of_a_sample_gets_the_same_tokens(prepared):
    wanted = [(0, 0), (1, 2), (3, 1)]
    here = IndexedTokens(prepared, micro_batch_size=MICRO_BATCH_SIZE, num_micro_batches=NUM_MICRO_BATCHES)
    # This process and a spawned rank (its own interpreter, hash seed and dataset objects)
    # are two readers; a rank's GPTDataset reads the indices prepare_data cached.
    (there,) = run_world(_read, 1, prepared.to_json(), wanted)
    for step, m in wanted:
        assert torch.equal(torch.from_numpy(there[f"{step}/{m}"]), here.micro_batch(step, m)["tokens"])


def test_samples_are_the_text_packed_between_end_of_document_tokens(prepared):
    tokenizer = load_tokenizer(Path(prepared.tokenizer))
    source = IndexedTokens(prepared, micro_batch_size=MICRO_BATCH_SIZE, num_micro_batches=NUM_MICRO_BATCHES)
    saw_boundary = False
    for step in range(STEPS):
        for row in source.micro_batch(step, 0)["tokens"].tolist():
            pieces = [[]]
            for token in row:
                pieces.append([]) if token == tokenizer.eos_token_id else pieces[-1].append(token)
            saw_boundary |= len(pieces) > 1
            for piece in pieces:
                text = tokenizer.decode(piece)
                assert any(text in line for line in LINES), text
    assert saw_boundary, "samples pack several documents"


def test_the_reading_tokenizer_is_the_writing_tokenizer(prepared):
    written = load_tokenizer(Path(prepared.tokenizer))
    read = load_megatron_tokenizer(Path(prepared.tokenizer))
    assert read.eod == written.eos_token_id and read.vocab_size == len(written) <= 320
    for line in LINES[:3]:
        assert read.tokenize(line) == written(line, add_special_tokens=False)["input_ids"]


class _Planted:
    """What another user could leave in the index cache: unpickling it makes a directory."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_an_index_cache_others_may_write_is_refused_before_megatron_unpickles_it(prepared, tmp_path):
    cache_dir, index_cache = Path(prepared.prefix).parents[1], Path(prepared.index_cache)
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700  # a new cache is made for its owner alone
    (shuffle,) = index_cache.glob("*shuffle_index.npy")
    original, marker = shuffle.read_bytes(), tmp_path / "ran"
    shuffle.write_bytes(pickle.dumps(_Planted(marker)))  # numpy.load(allow_pickle=True) would unpickle it
    cache_dir.chmod(0o755)
    index_cache.chmod(0o757)
    try:
        with pytest.raises(ConfigError, match=f"^{index_cache}: is writable by group or others"):
            prepare_data(corpus=str(cache_dir.parent / "notes.txt"), tokenizer=None, vocab_size=320,
                         seq_length=SEQ_LENGTH, num_samples=prepared.num_samples, seed=5, cache_dir=cache_dir)
        assert not marker.exists()
    finally:
        index_cache.chmod(0o755)
        cache_dir.chmod(0o700)
        shuffle.write_bytes(original)


def test_trained_tokenizer_is_cached_and_a_given_one_is_used_as_is(prepared, tmp_path):
    directory = Path(prepared.tokenizer)
    again = prepare_tokenizer(None, documents=iter(LINES), vocab_size=320, cache_dir=directory.parent)
    assert again == directory
    assert prepare_tokenizer(directory / "tokenizer.json", documents=iter(()), vocab_size=320,
                             cache_dir=tmp_path) == directory
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        prepare_tokenizer(tmp_path, documents=iter(()), vocab_size=320, cache_dir=tmp_path)
    small = tmp_path / "small.txt"
    small.write_text(LINES[0])
    with pytest.raises(ValueError, match="more than the model's vocab_size 300"):
        prepare_data(corpus=str(small), tokenizer=str(directory), vocab_size=300, seq_length=8, num_samples=1, seed=0,
                     cache_dir=tmp_path)


def test_python_docstrings_are_the_offline_default_corpus(tmp_path):
    json_package = Path(sysconfig.get_paths()["stdlib"]) / "json"
    documents = load_corpus("python-docstrings", cache_dir=tmp_path, docstring_root=json_package)["text"]
    assert any(doc.startswith("Serialize ``obj`` to a JSON formatted ``str``") for doc in documents)


def test_wikitext_comes_from_the_hub_cache_and_never_from_the_network(tmp_path):
    with pytest.raises(ValueError, match="no copy in the Hugging Face hub cache"):
        load_corpus("wikitext-2", cache_dir=tmp_path, hub_cache=tmp_path / "empty-hub")
    snapshot = tmp_path / "hub/datasets--Salesforce--wikitext/snapshots/0123abc/wikitext-2-raw-v1"
    snapshot.mkdir(parents=True)
    rows = ["", " = Valkyria Chronicles III = \n", " Senjō no Valkyria 3 is a tactical role @-@ playing game .\n"]
    datasets.Dataset.from_dict({"text": rows}).to_parquet(str(snapshot / "train-00000-of-00001.parquet"))
    assert load_corpus("wikitext-2", cache_dir=tmp_path, hub_cache=tmp_path / "hub")["text"] == rows


def test_a_local_directory_is_read_by_the_same_path(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus/a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "corpus/b.txt").write_text("third line\n")
    assert load_corpus(str(tmp_path / "corpus"), cache_dir=tmp_path / "cache")["text"] == [
        "first line", "second line", "third line"]
    (tmp_path / "corpus/c.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="mixes parquet and text files"):
        load_corpus(str(tmp_path / "corpus"), cache_dir=tmp_path / "cache")


def test_the_recipe_data_section_names_a_known_corpus_or_a_path(tmp_path):
    from odyssey_megatron.config import load_config
    from odyssey_megatron.errors import ConfigError

    assert load_config(None).data.corpus == "python-docstrings"
    assert load_config(None, [f"data.corpus={tmp_path}"]).data.corpus == str(tmp_path)
    with pytest.raises(ConfigError, match=r"^data.corpus: must be one of python-docstrings, wikitext-2, wikitext-103, "
                                          r"or a local file or directory; got 'wikitext-3'$"):
        load_config(None, ["data.corpus=wikitext-3"])
    with pytest.raises(ConfigError, match=r"^data.tokenizer: must be a Hugging Face tokenizer directory"):
        load_config(None, [f"data.tokenizer={tmp_path / 'llama'}"])
