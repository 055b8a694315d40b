"""Training data addressed by (step, global micro-batch id), so any rank can read any
micro-batch and a pipeline's data follows its micro-batch ids wherever a plan puts them:
after a re-plan no sample is skipped or seen twice.

``corpus`` (text documents through ``datasets``), ``tokenizer`` (Llama's or a trained
byte-level BPE), ``indexed`` (Megatron-Core's IndexedDataset and GPTDataset, and the
micro-batch source ``IndexedTokens``); ``synthetic`` (random tokens, for tests that only
need shapes and determinism).
"""

from odyssey_megatron.data.indexed import IndexedTokens, PreparedData, prepare_data, sample_ids
from odyssey_megatron.data.synthetic import SyntheticTokens

__all__ = ["IndexedTokens", "PreparedData", "SyntheticTokens", "prepare_data", "sample_ids"]
