"""The corpus tokenized into Megatron-Core's IndexedDataset and packed by its GPTDataset.

``prepare_data`` runs once, before any worker starts (on node 0, in a process of its own:
``runtime.data_preparation``; a test's parent): it tokenizes every document, appends the
end-of-document token, writes the ``.bin``/``.idx`` pair with ``IndexedDatasetBuilder``
and has ``GPTDataset`` build and cache its document, sample and shuffle indices (its C++
helpers ship compiled in the megatron-core wheel). Everything is cached under keys of its
inputs, so a rerun reuses it. GPTDataset loads its cached indices with
``numpy.load(allow_pickle=True)`` (a pickle if the file is not ``.npy``) and cannot be
told otherwise, so ``prepare_data`` opens a cache that only you could have written
(``file_trust``; a new cache directory is made for its owner alone). The workers open it
after that check: no one else can change it in between.

``IndexedTokens`` is what a rank reads from: global sample ``i`` is ``GPTDataset[i]``,
``seq_length + 1`` packed tokens chosen by the seeded shuffle, the same on every rank and
in every run. A micro-batch's samples follow from (step, global micro-batch id), so the
data position survives any re-plan, and over a run every sample id is consumed once.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy
import torch

from odyssey_megatron.data.corpus import corpus_files, load_corpus
from odyssey_megatron.data.tokenizer import load_megatron_tokenizer, load_tokenizer, prepare_tokenizer
from odyssey_megatron.file_trust import check_private

__all__ = ["IndexedTokens", "PreparedData", "open_dataset", "prepare_data", "sample_ids"]

_BATCH_DOCUMENTS = 1000


@dataclass(frozen=True)
class PreparedData:
    """What a reader needs to open the prepared corpus; plain data, shipped to workers as JSON."""

    prefix: str
    """Path prefix of the IndexedDataset's ``.bin`` and ``.idx`` files."""
    tokenizer: str
    """The Hugging Face tokenizer directory the corpus was tokenized with."""
    seq_length: int
    num_samples: int
    """Samples of ``seq_length + 1`` tokens the run may read (GPTDataset repeats epochs to reach it)."""
    seed: int
    """Seed of GPTDataset's document and sample shuffles."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PreparedData":
        return cls(**json.loads(text))

    @property
    def index_cache(self) -> str:
        return f"{self.prefix}-gpt-indices"


def _fingerprint(files: list[Path], tokenizer_dir: Path) -> str:
    digest = hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def _write_indexed(documents, tokenizer, prefix: str) -> None:
    """Every non-blank document as its token ids plus EOD, one IndexedDataset document each."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    partial = f"{prefix}.{os.getpid()}.tmp"
    builder = IndexedDatasetBuilder(f"{partial}.bin", dtype=DType.optimal_dtype(len(tokenizer)))
    for batch in documents.iter(batch_size=_BATCH_DOCUMENTS):
        texts = [text for text in batch["text"] if text and text.strip()]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
            ids.append(tokenizer.eos_token_id)
            builder.add_document(numpy.asarray(ids), [len(ids)])
    builder.finalize(f"{partial}.idx")
    os.replace(f"{partial}.bin", f"{prefix}.bin")
    os.replace(f"{partial}.idx", f"{prefix}.idx")  # last: its presence means the pair is whole


def prepare_data(
    *,
    corpus: str,
    tokenizer: Optional[str],
    vocab_size: int,
    seq_length: int,
    num_samples: int,
    seed: int,
    cache_dir: str | Path,
    hub_cache: Optional[Path] = None,
    docstring_root: Optional[Path] = None,
) -> PreparedData:
    """Tokenize, index and pack ``corpus`` (see ``data.corpus``) once; ``tokenizer`` is a
    Hugging Face tokenizer directory or None for a BPE trained on the corpus with at most
    ``vocab_size`` tokens. ValueError names what is wrong (no such corpus, a tokenizer
    larger than the model's vocabulary, too little text for one sample); ConfigError names
    a cache file another user could have written."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    files = corpus_files(corpus, cache_dir=cache_dir, hub_cache=hub_cache, docstring_root=docstring_root)
    documents = load_corpus(corpus, cache_dir=cache_dir, hub_cache=hub_cache, docstring_root=docstring_root)
    texts = (text for batch in documents.iter(batch_size=_BATCH_DOCUMENTS) for text in batch["text"] if text.strip())
    tokenizer_dir = prepare_tokenizer(tokenizer, documents=texts, vocab_size=vocab_size,
                                      cache_dir=cache_dir / "tokenizers")
    hf_tokenizer = load_tokenizer(tokenizer_dir)
    if len(hf_tokenizer) > vocab_size:
        raise ValueError(f"tokenizer {tokenizer_dir} has {len(hf_tokenizer)} tokens; "
                         f"more than the model's vocab_size {vocab_size}")
    prefix = cache_dir / "indexed" / f"{Path(corpus).stem}-{_fingerprint(files, tokenizer_dir)}"
    if not Path(f"{prefix}.idx").is_file():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        _write_indexed(documents, hf_tokenizer, str(prefix))
    prepared = PreparedData(str(prefix), str(tokenizer_dir), seq_length, num_samples, seed)
    check_private(Path(prepared.index_cache), root=cache_dir)
    dataset = open_dataset(prepared)  # builds and caches GPTDataset's indices
    if len(dataset) < 1:
        raise ValueError(f"corpus {corpus}: too little text for one sample of {seq_length + 1} tokens")
    return prepared


def open_dataset(prepared: PreparedData):
    """Megatron-Core's GPTDataset over the prepared IndexedDataset (indices from the cache)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    config = GPTDatasetConfig(
        random_seed=prepared.seed,
        sequence_length=prepared.seq_length,
        blend=([prepared.prefix], None),
        split="1,0,0",
        path_to_cache=prepared.index_cache,
        tokenizer=load_megatron_tokenizer(Path(prepared.tokenizer)),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    indexed = IndexedDataset(prepared.prefix)
    documents = numpy.arange(len(indexed.document_indices) - 1, dtype=numpy.int32)
    return GPTDataset(indexed, prepared.prefix, documents, prepared.num_samples, Split.train, config)


def sample_ids(prepared: PreparedData, step: int, micro_batch: int, *, micro_batch_size: int,
               num_micro_batches: int) -> list[int]:
    """The global samples of micro-batch ``micro_batch`` of step ``step`` (``IndexedTokens``'
    order), from the numbers alone: the controller's process records them without opening
    the dataset."""
    if not 0 <= micro_batch < num_micro_batches:
        raise IndexError(f"micro-batch {micro_batch} outside 0..{num_micro_batches - 1}")
    first = (step * num_micro_batches + micro_batch) * micro_batch_size
    ids = list(range(first, first + micro_batch_size))
    if step < 0 or ids[-1] >= prepared.num_samples:
        steps = _whole_steps(prepared, micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches)
        raise IndexError(f"step {step} needs samples up to {ids[-1]}; the data was prepared for "
                         f"{prepared.num_samples} ({steps} steps)")
    return ids


def _whole_steps(prepared: PreparedData, *, micro_batch_size: int, num_micro_batches: int) -> int:
    return prepared.num_samples // (num_micro_batches * micro_batch_size)


class IndexedTokens:
    """Micro-batches of the prepared corpus, addressed like ``SyntheticTokens``: micro-batch
    ``m`` of step ``s`` holds global samples ``(s * num_micro_batches + m) * micro_batch_size``
    onwards, whichever rank reads it."""

    def __init__(self, prepared: PreparedData, *, micro_batch_size: int, num_micro_batches: int):
        self.prepared = prepared
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.dataset = open_dataset(prepared)

    @property
    def num_steps(self) -> int:
        """Whole steps the prepared samples cover."""
        return _whole_steps(self.prepared, micro_batch_size=self.micro_batch_size,
                            num_micro_batches=self.num_micro_batches)

    def sample_ids(self, step: int, micro_batch: int) -> list[int]:
        return sample_ids(self.prepared, step, micro_batch, micro_batch_size=self.micro_batch_size,
                          num_micro_batches=self.num_micro_batches)

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """``tokens``, ``labels``, ``loss_mask``, ``position_ids`` [micro_batch_size, seq_length]
        and the ``sample_ids`` they came from."""
        ids = self.sample_ids(step, micro_batch)
        samples = [self.dataset[i] for i in ids]
        batch = {key: torch.stack([sample[key] for sample in samples])
                 for key in ("tokens", "labels", "loss_mask", "position_ids")}
        batch["sample_ids"] = torch.tensor(ids)
        return batch
