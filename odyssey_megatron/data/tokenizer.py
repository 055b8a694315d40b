"""The tokenizer: a given Hugging Face one (Llama's), or a byte-level BPE trained here.

Either way it ends up as a Hugging Face tokenizer directory (``tokenizer.json`` and
``tokenizer_config.json``) that transformers loads for writing the indexed corpus and
Megatron-Core's ``HuggingFaceTokenizer`` loads for reading it, so both sides agree on
every id and on the end-of-document token that separates packed documents.

The trained BPE learns from the first ``TRAIN_CHARS`` characters of the corpus (well
under a second) and is cached under a key of that text and the vocabulary size, so every
process and every rerun gets the same tokenizer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["EOD", "TRAIN_CHARS", "load_megatron_tokenizer", "load_tokenizer", "prepare_tokenizer",
           "train_byte_level_bpe"]

EOD = "<|endoftext|>"
TRAIN_CHARS = 1_000_000
_MIN_VOCAB = 256 + 1  # every byte, and the end-of-document token


def train_byte_level_bpe(texts: Iterable[str], *, vocab_size: int):
    """A byte-level BPE (GPT-2 style: any text encodes, nothing is unknown) over ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"a byte-level BPE needs vocab_size >= {_MIN_VOCAB} (256 bytes + {EOD}); got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _training_texts(documents: Iterable[str]) -> list[str]:
    texts, total = [], 0
    for text in documents:
        texts.append(text)
        total += len(text)
        if total >= TRAIN_CHARS:
            break
    return texts


def prepare_tokenizer(path: Optional[str | Path], *, documents: Iterable[str], vocab_size: int,
                      cache_dir: Path) -> Path:
    """The tokenizer directory: ``path`` itself (a Hugging Face tokenizer directory, or the
    ``tokenizer.json`` in one) when given, else a BPE trained on ``documents`` and cached in
    ``cache_dir``. ValueError names what is wrong."""
    if path is not None:
        path = Path(path)
        directory = path.parent if path.name == "tokenizer.json" else path
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer {path}: no tokenizer.json there (a Hugging Face tokenizer directory is needed)")
        return directory
    from transformers import PreTrainedTokenizerFast

    texts = _training_texts(documents)
    key = hashlib.sha256(f"{vocab_size}\0".encode() + "\0".join(texts).encode()).hexdigest()[:16]
    directory = Path(cache_dir) / f"bpe-{vocab_size}-{key}"
    if not (directory / "tokenizer.json").is_file():
        partial = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
        shutil.rmtree(partial, ignore_errors=True)
        trained = train_byte_level_bpe(texts, vocab_size=vocab_size)
        PreTrainedTokenizerFast(tokenizer_object=trained, eos_token=EOD).save_pretrained(str(partial))
        try:
            os.replace(partial, directory)
        except OSError:  # another process cached the same tokenizer first
            shutil.rmtree(partial, ignore_errors=True)
    return directory


def load_tokenizer(directory: Path):
    """The transformers fast tokenizer of ``directory`` (local files only); it must name an EOS token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), use_fast=True, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {directory}: names no eos_token to separate documents with")
    return tokenizer


def load_megatron_tokenizer(directory: Path):
    """Megatron-Core's tokenizer over the same directory (what GPTDataset reads eod and pad from)."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(str(directory), metadata_path={"library": "huggingface", "model_type": "gpt"},
                                             use_fast=True)
