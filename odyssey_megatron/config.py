"""Recipe configuration: Megatron-style sections plus the ``odyssey:`` section.

Structured omegaconf configs (one dataclass per component) merged in this order:
schema defaults, the shipped model spec named by ``model.spec``, the recipe YAML, then
command-line dotlist overrides. ``OmegaConf.to_object`` builds the dataclasses so each
``__post_init__`` validates its own fields; cross-section checks live on ``RecipeConfig``.
A recipe in Megatron-Bridge's layout is renamed onto these sections first
(``bridge_recipe``). Fixed choices are ``Choice`` enums. The loading, merging and one-line
errors are ``typed_yaml``'s, shared with the simulator's scenarios; the size and cost limits
come from ``limits``. Every problem becomes a ``ConfigError`` naming the key and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf

from odyssey_megatron import limits
from odyssey_megatron.bridge_recipe import BridgeRecipe, is_bridge_recipe
from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.phases import FaultPhase
from odyssey_megatron.settings import DecisionSettings, Pricing, SearchSettings
from odyssey_megatron.specs import CORPUS_SPECS, DEVICE_SPECS, MODEL_SPECS
from odyssey_megatron.specs.hf_config import read_model_fields
from odyssey_megatron.timeouts import TIMEOUT_ORDER, Timeouts
from odyssey_megatron.typed_yaml import (
    Choice,
    build_structured,
    choice,
    read_layers,
    require,
    require_at_most,
    require_non_negative,
    require_plain_numbers,
    require_positive,
)

__all__ = [
    "BatchOnFailure",
    "ClusterConfig",
    "DataConfig",
    "DType",
    "Device",
    "FaultAction",
    "FaultSpec",
    "LengthSweep",
    "LoggerConfig",
    "LrDecayStyle",
    "LrWsdDecayStyle",
    "ModelConfig",
    "OdysseyConfig",
    "ParallelConfig",
    "Policy",
    "RecipeConfig",
    "StragglerAction",
    "TrainingConfig",
    "WeightDecayIncrStyle",
    "config_yaml",
    "load_config",
    "load_recipe",
]


class DType(Choice):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Policy(Choice):
    auto = "auto"
    reroute = "reroute"
    reparallelize = "reparallelize"


class StragglerAction(Choice):
    report = "report"
    remove = "remove"


LrDecayStyle = Choice("LrDecayStyle", [(name, name) for name in ("constant", "linear", "cosine",
                                                                   "inverse-square-root", "WSD")], module=__name__)
"""How the learning rate falls after the warmup, Megatron-Core's ``OptimizerParamScheduler``'s
``lr_decay_style`` (a functional enum: ``inverse-square-root`` is no Python name)."""


class LrWsdDecayStyle(Choice):
    """How WSD's last ``lr_wsd_decay_iters`` steps fall to ``min_lr`` (Megatron's ``lr_wsd_decay_style``)."""

    linear = "linear"
    cosine = "cosine"
    exponential = "exponential"
    minus_sqrt = "minus_sqrt"


class WeightDecayIncrStyle(Choice):
    """How the weight decay goes from ``start_weight_decay`` to ``end_weight_decay`` over the run."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class LengthSweep(Choice):
    joins = "joins"
    always = "always"
    never = "never"


class BatchOnFailure(Choice):
    keep = "keep"
    shrink = "shrink"


JOIN_PHASES = (FaultPhase.recovery, FaultPhase.transfer, FaultPhase.mid_transfer, FaultPhase.group_setup,
               FaultPhase.mid_group_setup)
"""Where a ``join`` fault may strike: a generation that takes workers back, before its first step."""

FaultAction = Choice("FaultAction", [(name, name) for name in ("kill", "stop", "raise", "slow")],
                     module=__name__)
"""What an injected fault does: kill (SIGKILL), stop (SIGSTOP: a hung worker), raise (an
exception in the training loop) or slow (each op takes ``factor`` times as long for
``steps`` steps: a straggler that stays alive). A functional enum, since ``raise`` is a
Python keyword."""


Device = Choice("Device", [(name, name) for name in sorted(DEVICE_SPECS)], module=__name__)
"""The shipped device specs (``specs.devices``)."""

_WANDB_FORBIDDEN = "/\\#?%:"
"""Characters W&B refuses in a project name."""


def require_wandb_project(key: str, name: str) -> None:
    bad = sorted(set(name) & set(_WANDB_FORBIDDEN))
    require(0 < len(name) <= 128 and not bad, key,
            f"must be 1 to 128 characters without any of {' '.join(_WANDB_FORBIDDEN)}; got {name!r}")


_SPEC_ALLOWED = (
    f"must be one of {', '.join(sorted(MODEL_SPECS))}, or a path to a Hugging Face config.json "
    "(or a directory holding one)"
)


@dataclass
class ModelConfig:
    """Transformer architecture, in Megatron-Core's names (Llama-style: RoPE, SwiGLU, RMSNorm)."""

    spec: Optional[str] = None
    """A shipped architecture (llama2-7b, llama2-13b, llama2-70b) or a Hugging Face Llama
    ``config.json`` (or a directory holding one) that fills the fields below; fields given in
    the recipe or on the command line still win."""
    num_layers: int = 32
    """Transformer layers (embedding and output head come on top)."""
    hidden_size: int = 4096
    ffn_hidden_size: int = 11008
    num_attention_heads: int = 32
    num_query_groups: Optional[int] = None
    """Key/value heads (grouped-query attention); default: num_attention_heads (MHA)."""
    vocab_size: int = 32000
    seq_length: int = 4096
    tie_embeddings: bool = False
    """Share the input embedding with the output projection (Llama-2 does not)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies (Megatron's rotary_base)."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon (Megatron's layernorm_epsilon; Llama-2's rms_norm_eps)."""
    params_dtype: DType = DType.bf16
    """Compute dtype of parameters and activations: bf16, fp16 or fp32."""

    def __post_init__(self) -> None:
        require_plain_numbers("model", self)
        self.params_dtype = choice("model.params_dtype", DType, self.params_dtype)
        if self.spec is not None and self.spec not in MODEL_SPECS:
            require(Path(self.spec).exists(), "model.spec", _SPEC_ALLOWED + f"; got {self.spec!r}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        dimensions = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                      "vocab_size", "seq_length")
        require_positive("model", self, "num_layers", *dimensions, "rope_theta", "norm_epsilon")
        require_at_most("model", self, limits.MAX_LAYERS, "per-layer transfers and sync rounds", "num_layers")
        require_at_most("model", self, limits.MAX_MODEL_DIMENSION, "larger overflows the profile", *dimensions)
        require(
            self.hidden_size % self.num_attention_heads == 0, "model.hidden_size",
            f"must be divisible by model.num_attention_heads ({self.num_attention_heads}); got {self.hidden_size}",
        )
        require(
            self.num_attention_heads % self.num_query_groups == 0, "model.num_query_groups",
            f"must divide model.num_attention_heads ({self.num_attention_heads}); got {self.num_query_groups}",
        )

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.params_dtype == "fp32" else 2


@dataclass
class ParallelConfig:
    """The initial (failure-free) layout; Odyssey changes DP and PP after failures, never TP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: Optional[int] = None
    """Default: derived as Megatron derives it, world size / (TP * PP), the world size being
    parallel.world_size, cluster.num_nodes * cluster.devices_per_node or the launcher's
    WORLD_SIZE, the first given, else 1 (``RecipeConfig``)."""
    world_size: Optional[int] = None
    """Ranks the job launches; with data_parallel_size given, must equal TP * PP * DP (a
    guard against a mistyped layout)."""

    def __post_init__(self) -> None:
        require_plain_numbers("parallel", self)
        sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
        given = sizes + tuple(name for name in ("data_parallel_size", "world_size") if getattr(self, name) is not None)
        require_positive("parallel", self, *given)
        require_at_most("parallel", self, limits.MAX_WORKERS, "the most workers planned over", *given)
        if self.world_size is None:
            return
        if self.data_parallel_size is None:
            self.derive_data_parallel_size(self.world_size, "parallel.world_size")
        else:
            require(
                self.world_size == self.num_ranks, "parallel.world_size",
                "must equal tensor_model_parallel_size * pipeline_model_parallel_size * data_parallel_size = "
                f"{self.num_ranks}; got {self.world_size}",
            )

    def derive_data_parallel_size(self, world_size: int, key: str) -> None:
        """DP = world size / (TP * PP), as Megatron derives it (context parallelism is 1);
        ``key`` names where the world size came from."""
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        require(
            world_size % model_parallel == 0, key,
            f"gives a world size of {world_size}, which must be divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size = {model_parallel}",
        )
        self.data_parallel_size = world_size // model_parallel

    @property
    def num_ranks(self) -> int:
        """TP * PP * DP: the ranks the recipe launches."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size


@dataclass
class TrainingConfig:
    """Batch and step settings, as Megatron's training arguments."""

    global_batch_size: int = 16
    micro_batch_size: int = 1
    train_iters: int = 100
    lr: float = 3.0e-4
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (Megatron's name); 0 turns clipping off."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay; biases and 1-D tensors (norms) take none, as in Megatron."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    seed: int = 1234
    lr_warmup_iters: int = 0
    """Steps over which the learning rate rises linearly from lr_warmup_init to lr (Megatron's
    names, as every key down to weight_decay_incr_style: its ``OptimizerParamScheduler``,
    ``hooks.lr_schedule``, sets each step's rate from the committed step). Give this or
    lr_warmup_fraction, not both."""
    lr_warmup_fraction: Optional[float] = None
    """The warmup as a fraction of lr_decay_iters, in [0, 1); default: lr_warmup_iters."""
    lr_warmup_init: float = 0.0
    """The learning rate of the warmup's first step, at most lr."""
    lr_decay_style: LrDecayStyle = LrDecayStyle["constant"]
    """After the warmup: constant (lr throughout), linear or cosine (from lr to min_lr at
    lr_decay_iters), inverse-square-root, or WSD (lr until the last lr_wsd_decay_iters steps of
    lr_decay_iters, then down to min_lr by lr_wsd_decay_style)."""
    lr_decay_iters: Optional[int] = None
    """The step the decay reaches min_lr (and stays there); default: train_iters."""
    min_lr: float = 0.0
    """Where the decay ends, at most lr."""
    lr_wsd_decay_style: LrWsdDecayStyle = LrWsdDecayStyle.exponential
    """WSD's decay: linear, cosine, exponential or minus_sqrt."""
    lr_wsd_decay_iters: Optional[int] = None
    """WSD's decay steps, 1 .. lr_decay_iters (required with WSD)."""
    start_weight_decay: Optional[float] = None
    """The weight decay of the first step; default: weight_decay."""
    end_weight_decay: Optional[float] = None
    """The weight decay of the last step, at least start_weight_decay; default: weight_decay."""
    weight_decay_incr_style: WeightDecayIncrStyle = WeightDecayIncrStyle.constant
    """constant (start_weight_decay and end_weight_decay must then agree), linear or cosine over train_iters."""

    def __post_init__(self) -> None:
        require_plain_numbers("training", self)
        require_positive("training", self, "global_batch_size", "micro_batch_size", "train_iters", "lr")
        require_non_negative("training", self, "seed", "clip_grad", "weight_decay")
        require_positive("training", self, "adam_eps")
        for key in ("adam_beta1", "adam_beta2"):
            require(0 <= getattr(self, key) < 1, f"training.{key}", f"must be in [0, 1); got {getattr(self, key)}")
        require(
            self.global_batch_size % self.micro_batch_size == 0, "training.global_batch_size",
            f"must be divisible by training.micro_batch_size ({self.micro_batch_size}); got {self.global_batch_size}",
        )
        self._check_schedule()

    def _check_schedule(self) -> None:
        """The learning-rate and weight-decay schedule: what Megatron's scheduler asserts, as
        one-line errors."""
        self.lr_decay_style = choice("training.lr_decay_style", LrDecayStyle, self.lr_decay_style)
        self.lr_wsd_decay_style = choice("training.lr_wsd_decay_style", LrWsdDecayStyle, self.lr_wsd_decay_style)
        self.weight_decay_incr_style = choice("training.weight_decay_incr_style", WeightDecayIncrStyle,
                                              self.weight_decay_incr_style)
        require_non_negative("training", self, "lr_warmup_iters")
        for key in ("min_lr", "lr_warmup_init"):
            value = getattr(self, key)
            require(0 <= value <= self.lr, f"training.{key}", f"must be in [0, training.lr ({self.lr})]; got {value}")
        for key in ("lr_decay_iters", "lr_wsd_decay_iters"):
            if getattr(self, key) is not None:
                require_positive("training", self, key)
        if self.lr_warmup_fraction is not None:
            require(self.lr_warmup_iters == 0, "training.lr_warmup_fraction",
                    f"give it or training.lr_warmup_iters, not both; got {self.lr_warmup_fraction} and "
                    f"{self.lr_warmup_iters}")
            require(0 <= self.lr_warmup_fraction < 1, "training.lr_warmup_fraction",
                    f"must be in [0, 1) (of training.lr_decay_iters); got {self.lr_warmup_fraction}")
        else:
            require(self.lr_warmup_iters < self.decay_iters, "training.lr_warmup_iters",
                    f"must be below training.lr_decay_iters ({self.decay_iters}: the warmup ends before the "
                    f"decay does); got {self.lr_warmup_iters}")
        if self.lr_decay_style == "WSD":
            require(self.lr_wsd_decay_iters is not None and 1 <= self.lr_wsd_decay_iters <= self.decay_iters,
                    "training.lr_wsd_decay_iters", f"must be given with lr_decay_style WSD, 1 .. "
                    f"training.lr_decay_iters ({self.decay_iters}); got {self.lr_wsd_decay_iters}")
        start, end = self.weight_decay_range
        require(start >= 0, "training.start_weight_decay", f"must be >= 0; got {start}")
        require(end >= start, "training.end_weight_decay",
                f"must be >= training.start_weight_decay ({start}); got {end}")
        require(self.weight_decay_incr_style != "constant" or start == end, "training.weight_decay_incr_style",
                f"is constant, so training.start_weight_decay ({start}) and training.end_weight_decay ({end}) must "
                "agree; give linear or cosine to change the weight decay over the run")

    @property
    def decay_iters(self) -> int:
        """The step the learning rate's decay ends: lr_decay_iters, or train_iters."""
        return self.train_iters if self.lr_decay_iters is None else self.lr_decay_iters

    @property
    def weight_decay_range(self) -> tuple[float, float]:
        """(start, end) weight decay: start_weight_decay and end_weight_decay, each weight_decay where not given."""
        return tuple(self.weight_decay if wd is None else wd for wd in (self.start_weight_decay, self.end_weight_decay))

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per global batch, summed over all pipelines."""
        return self.global_batch_size // self.micro_batch_size


@dataclass
class ClusterConfig:
    """The hardware the recipe runs on."""

    device: Device = Device["ascend-910b"]
    """A shipped device spec: ascend-910b, a100-80gb, h100-80gb or cpu."""
    devices_per_node: int = 8
    """Accelerators per machine; a node failure takes all of them."""
    emulate_device: Optional[str] = None
    """Device-time emulation for runs of the runtime (``runtime.rank.emulation``): every
    forward, backward, weight-gradient op, P2P message and DP all-reduce takes the time this
    profile gives it (real work done, then padded by waiting), so CPU ranks sharing a few
    cores behave like devices of that profile. A shipped device name (its analytic profile
    of the recipe's model) or a profile JSON file (``profile_file``); default: off, real time."""
    num_nodes: Optional[int] = None
    """Machines with devices the job runs on (torchrun's --nnodes, less the controller's own
    node if it has one): with devices_per_node, the world size, which gives the
    data-parallel size when the recipe does not (and must match it when it does)."""
    dedicated_controller: bool = False
    """``odyssey train``: node 0 runs the controller and its store only, no workers (a CPU
    host can take it), so no device or worker failure takes the run's one central process
    with it; the devices' nodes are 1 .. nnodes-1 (launch one more node than num_nodes)."""
    disk_write_gb_s: float = 2.0
    """Write bandwidth (GB/s) from one node to the filesystem that holds the run directory,
    shared by the node's ranks: what a disk checkpoint's save is priced at
    (``estimator.checkpoint``), which sets the default ``odyssey.checkpoint_interval``. The
    default, 2 GB/s a node, is a parallel filesystem's share over one node's link."""
    host_memory_gib: Optional[float] = None
    """Host memory (GiB) a node may give the in-memory snapshots' keepers, their parity
    temporaries and the checkpoint staging buffers (``estimator.host_memory``): ``odyssey
    plan`` and ``odyssey train`` refuse a plan that needs more on any node. Default: not
    checked (a node's RAM depends on the server and its cgroup, not on the accelerator:
    a DGX H100 has 2 TiB, a container often a small share of it); set what the node's
    limit leaves after the processes themselves."""

    def __post_init__(self) -> None:
        require_plain_numbers("cluster", self)
        self.device = choice("cluster.device", Device, self.device)
        given = ("devices_per_node",) + (("num_nodes",) if self.num_nodes is not None else ())
        require_positive("cluster", self, *given)
        require(self.disk_write_gb_s >= 1e-3, "cluster.disk_write_gb_s",
                f"must be >= 0.001 (1 MB/s); got {self.disk_write_gb_s}")
        require_at_most("cluster", self, 1e6, "a million GB/s", "disk_write_gb_s")
        if self.host_memory_gib is not None:
            require(self.host_memory_gib > 0, "cluster.host_memory_gib", f"must be > 0, got {self.host_memory_gib}")
            require_at_most("cluster", self, 2.0**20, "a PiB per node", "host_memory_gib")
        require_at_most("cluster", self, limits.MAX_DEVICES_PER_NODE, "larger than any machine", "devices_per_node")
        require(self.emulate_device is None or bool(self.emulate_device.strip()), "cluster.emulate_device",
                f"must be one of {', '.join(sorted(DEVICE_SPECS))} or a profile JSON file; got an empty string")
        require_at_most("cluster", self, limits.MAX_WORKERS, "the most workers planned over", *given[1:])

    @property
    def world_size(self) -> Optional[int]:
        return None if self.num_nodes is None else self.num_nodes * self.devices_per_node


@dataclass
class DataConfig:
    """Training text and tokenizer (``odyssey_megatron.data``); nothing is ever downloaded."""

    corpus: str = "python-docstrings"
    """python-docstrings (the standard library's, offline), wikitext-2 or wikitext-103 (from
    a Hugging Face hub cache), or a local .txt/.jsonl/.parquet file or directory."""
    tokenizer: Optional[str] = None
    """A Hugging Face tokenizer directory (Llama's tokenizer.json); default: a byte-level BPE
    trained on the corpus with at most model.vocab_size tokens."""
    cache_dir: str = "runs/cache/data"
    """Where the docstring corpus, the trained tokenizer and the indexed corpus are cached."""

    def __post_init__(self) -> None:
        require(
            self.corpus in CORPUS_SPECS or Path(self.corpus).exists(), "data.corpus",
            f"must be one of {', '.join(CORPUS_SPECS)}, or a local file or directory; got {self.corpus!r}",
        )
        if self.tokenizer is not None:
            require(Path(self.tokenizer).exists(), "data.tokenizer",
                    f"must be a Hugging Face tokenizer directory or its tokenizer.json; no such path: {self.tokenizer}")


@dataclass
class LoggerConfig:
    """Weights & Biases, in Megatron's names; W&B logs offline unless a project is given."""

    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    """The run's name."""
    wandb_entity: Optional[str] = None
    """The W&B team or user the run belongs to."""
    wandb_save_dir: Optional[str] = None
    """Where the W&B run directory goes; default: inside the run directory."""
    log_interval: int = 100
    """``odyssey train`` prints a progress line every this many committed steps (step,
    loss, samples/s, tokens/s, ranks training, time left). Megatron's and Bridge's default:
    a recipe written their way logs as they do; a short run (the tiny recipe) sets 1."""

    def __post_init__(self) -> None:
        require_positive("logger", self, "log_interval")
        if self.wandb_project is not None:
            require_wandb_project("logger.wandb_project", self.wandb_project)
        for name in ("wandb_exp_name", "wandb_entity", "wandb_save_dir"):
            value = getattr(self, name)
            require(value is None or bool(value.strip()), f"logger.{name}", "must not be empty; leave it out instead")


@dataclass
class FaultSpec:
    """One failure injected into a run (``runtime.rank.fault_injection``): a rank, or a
    whole node, fails the first time it reaches ``phase`` of training step ``step``. Its
    key (``odyssey.faults[i]``) comes from the list, so the checks take it as an argument."""

    rank: Optional[int] = None
    """The rank that fails, 0 .. world size - 1; give either rank or node."""
    node: Optional[int] = None
    """The node that fails with all its ranks (its launcher is killed), 1 .. nodes - 1:
    node 0 hosts the controller, whose loss ends the run."""
    step: Optional[int] = None
    """The training step it strikes in, 0 .. training.train_iters - 1 (required unless ``join``)."""
    phase: Optional[FaultPhase] = None
    """A ``phases.FaultPhase``: recovery, transfer, mid_transfer, group_setup, mid_group_setup,
    snapshot, forward, backward, grad_sync or optimizer (required, except for slow)."""
    action: FaultAction = MISSING
    """kill (SIGKILL), stop (SIGSTOP: a hung worker), raise (an exception in the training
    loop) or slow (from ``step`` on, for ``steps`` steps, each op of the rank sleeps
    ``factor - 1`` times its own time: its heartbeats go on); a node fault is always kill."""
    with_ranks: list[int] = field(default_factory=list)
    """Other ranks of ``rank``'s node killed in the same instant: ``rank`` carries the fault
    out, SIGKILLing them (wherever they are in their step) and then itself, so they fail
    together, not one after another. Kill only; default: none."""
    join: bool = False
    """Strike in the first generation that takes workers back (``odyssey.restart_workers``, a
    replacement node), at ``phase``, instead of at a step: when a join happens depends on
    how fast the worker restarts. Recovery phases only (recovery, transfer, mid_transfer,
    group_setup, mid_group_setup), on the joining worker (receiving its blocks) or any other rank of the
    generation; default: false."""
    factor: Optional[float] = None
    """slow only (required there): how many times its own time each op takes, above 1."""
    steps: Optional[int] = None
    """slow only (required there): how many steps, from ``step``, the rank stays slow."""

    def check(self, key: str) -> None:
        """What the spec alone decides: the choices, and exactly one target."""
        self.action = choice(f"{key}.action", FaultAction, self.action)
        if self.action == "slow":
            self._check_slow(key)
        else:
            require(self.phase is not None, f"{key}.phase", f"must be given for action {self.action}")
            self.phase = choice(f"{key}.phase", FaultPhase, self.phase)
            for name in ("factor", "steps"):
                require(getattr(self, name) is None, f"{key}.{name}",
                        f"goes with action slow only; got {getattr(self, name)} with action {self.action}")
        targets = {name: getattr(self, name) for name in ("rank", "node") if getattr(self, name) is not None}
        require(len(targets) == 1, key, "must give exactly one of rank and node; got "
                + (" and ".join(f"{name} {value}" for name, value in targets.items()) or "neither"))
        if self.join:
            require(self.step is None, f"{key}.step", f"must be left out with join (it strikes in the first "
                                                      f"generation that takes workers back); got {self.step}")
            require(self.phase in JOIN_PHASES, f"{key}.phase",
                    f"must be one of {', '.join(JOIN_PHASES)} with join; got {self.phase}")
        else:
            require(self.step is not None, f"{key}.step", "must be given (or join: true, for the first join)")
        require(self.node is None or self.action == "kill", f"{key}.action",
                f"must be kill for a node fault (a node is lost whole: its launcher and workers die); got {self.action}")
        if self.with_ranks:
            require(self.rank is not None, f"{key}.with_ranks", "must go with rank, not node (a node fails whole)")
            require(self.action == "kill", f"{key}.action",
                    f"must be kill for ranks failing together (with_ranks); got {self.action}")
            require(self.rank not in self.with_ranks and len(set(self.with_ranks)) == len(self.with_ranks),
                    f"{key}.with_ranks", f"must name other ranks than rank {self.rank}, each once; got {self.with_ranks}")

    def _check_slow(self, key: str) -> None:
        """A slow rank: one rank, from a step, for some steps, by a factor; no phase."""
        require(self.phase is None, f"{key}.phase", f"must be left out with action slow (it slows every op of "
                                                    f"its steps); got {self.phase}")
        require(self.node is None and not self.with_ranks and not self.join, key,
                "action slow takes one rank and a step (no node, with_ranks or join)")
        require(self.factor is not None and self.factor > 1.0, f"{key}.factor",
                f"must be a number above 1 with action slow (each op takes factor times its time); got {self.factor}")
        require(self.steps is not None and self.steps >= 1, f"{key}.steps",
                f"must be at least 1 with action slow (how many steps the rank stays slow); got {self.steps}")

    def slows(self, step: int) -> bool:
        """A slow fault that holds at ``step``."""
        return self.action == "slow" and self.step <= step < self.step + self.steps

    def check_within(self, key: str, *, num_ranks: int, devices_per_node: int, train_iters: int,
                     dedicated_controller: bool = False, snapshot_interval: Optional[int] = None) -> None:
        """Its target and step exist in the recipe's run, and a snapshot fault's step takes a
        snapshot (``snapshot_interval``, set). Nodes are numbered as launched: node 0 hosts
        the controller, beside its workers unless ``dedicated_controller``."""
        cluster = ClusterState(world_size=num_ranks, devices_per_node=devices_per_node)
        if self.rank is not None:
            require(0 <= self.rank < num_ranks, f"{key}.rank",
                    f"must lie in 0..{num_ranks - 1} (the recipe's {num_ranks} ranks); got {self.rank}")
        else:
            nodes = cluster.num_nodes
            last = nodes if dedicated_controller else nodes - 1
            allowed = f"must lie in 1..{last}" if last >= 1 else "names no node that may fail: aim it at a rank"
            where = (f", nodes 1..{nodes}: node 0 is the dedicated controller's" if dedicated_controller
                     else ", and node 0 hosts the controller")
            require(1 <= self.node <= last, f"{key}.node",
                    f"{allowed} (the recipe's {num_ranks} ranks fill {nodes} node(s) of cluster.devices_per_node="
                    f"{devices_per_node}{where}, whose loss ends the run); got {self.node}")
        for peer in self.with_ranks:
            node = cluster.node_ranks(cluster.node_of_rank(self.rank))
            require(peer in node, f"{key}.with_ranks",
                    f"must name ranks of rank {self.rank}'s node, {node[0]}..{node[-1]}"
                    f" (cluster.devices_per_node={devices_per_node}): it kills their pids; got {peer}")
        require(self.step is None or 0 <= self.step < train_iters, f"{key}.step",
                f"must lie in 0..{train_iters - 1} (training.train_iters is {train_iters}); got {self.step}")
        if self.phase == FaultPhase.snapshot:
            require(bool(snapshot_interval) and self.step > 0 and self.step % snapshot_interval == 0, f"{key}.step",
                    f"must be a step that takes a snapshot (a positive multiple of odyssey.snapshot_interval, "
                    f"{snapshot_interval}) for phase snapshot; got {self.step}")

    @property
    def target(self) -> str:
        if self.with_ranks:
            return f"ranks {', '.join(map(str, [self.rank, *self.with_ranks]))}"
        return f"rank {self.rank}" if self.rank is not None else f"node {self.node}"

    def __str__(self) -> str:
        if self.action == "slow":
            return f"slow {self.target} x{self.factor:g} for steps {self.step}..{self.step + self.steps - 1}"
        when = "in the first join" if self.join else f"at step {self.step}"
        return f"{self.action} {self.target} {when}, {self.phase}"


@dataclass
class OdysseyConfig:
    """How Odyssey decides after a failure (paper 001, section IV)."""

    policy: Policy = Policy.auto
    """auto (Eq. 8 picks), reroute (ReCycle-style only) or reparallelize (dynamic parallelism only)."""
    device_mtbf_hours: float = 10.0
    """Mean time between failures of one device; 10 h is the paper's 10%/h failure rate.
    The expected time to the next failure is this divided by the surviving devices."""
    learn_failure_rate: bool = True
    """From the first failure on, Eq. 8's rate is the failures seen over the device-hours
    exposed since the run started (``planner.policy.FailureRateModel``); false: the MTBF throughout."""
    dp_search_radius: int = 2
    """Candidate DP degrees lie within this distance of the current one (Algorithm 1's R_dp)."""
    pp_search_radius: int = 1
    """Candidate pipeline lengths lie within this distance of an even split (Algorithm 1's R_pp)."""
    length_sweep: LengthSweep = LengthSweep.joins
    """When the search also tries every pipeline length, then the DP radius around the best
    of them: joins (decisions off the critical path: workers came back and the current plan
    trains while the search runs), always (failures too: better plans, slower decisions) or never
    (the paper's window alone)."""
    batch_on_failure: BatchOnFailure = BatchOnFailure.keep
    """What a failure may do to the global batch: keep (every plan trains the recipe's
    batch: the exact run) or shrink (after a failure Eq. 8 may also choose to drop the
    broken pipelines' micro-batches, the whole pipelines going on with theirs, as
    torchft's replica drop does; the samples dropped are reported, and the recipe's
    batch stays the target every later decision may go back to: ``planner.shrink``).
    ``odyssey plan`` and ``odyssey simulate`` model it; ``odyssey train`` refuses it (its
    steps train the recipe's whole batch)."""
    decoupled_weight_grads: bool = True
    """Workers split each backward and run the weight-gradient half when nothing else is
    ready, which moves work (a rerouting peer's adopted work above all) into pipeline
    bubbles (paper 003's Decoupled BackProp), where that is faster and fits in memory;
    every plan, failure-free or rerouted, gets the same choice. False keeps plain 1F1B
    op lists."""
    distributed_optimizer: bool = False
    """Shard each stage's optimizer state (fp32 master weights and Adam moments) across its
    data-parallel peers as Megatron-Core's distributed optimizer does, every range of a
    block's state on two of them so one failure loses none (``optimizer_shards``); a Bridge recipe's
    use_distributed_optimizer sets it. ``odyssey plan`` and ``odyssey simulate`` price the
    memory it frees and the weight all-gather it adds; ``odyssey train`` turns it off and
    says so (its ranks keep a full copy, ``runtime.train.as_trained``)."""
    staggered_optimizer: bool = True
    """Each rank steps its optimizer as soon as its own DP peers are done instead of after
    the global gradient norm, so stages that finish early start the next step early
    (paper 003's Staggered Optimizer), on plans where that shortens the step. Exact: the
    next step runs ahead only until it would send a result or write a gradient, and a
    step that clipping should have scaled is retaken there (``runtime.rank.staggered_step``).
    ``odyssey plan`` and ``odyssey simulate`` model it; ``odyssey train`` turns it off (a
    staggered rank would step before its step commits) and prices its plans without it."""
    max_layer_splits: int = 256
    """Remainder placements enumerated per pipeline length before falling back to a heuristic set."""
    prepared_decisions_mib: float = 150.0
    """Controller memory for decisions priced in advance (``DecisionCenter.prepare``), at
    about 1.2 KB per rank per decision: a decision for every worker and node up to a few
    hundred ranks; beyond, on a symmetric plan, one per stage and node shape, renamed for
    every equivalent failure (``planner.symmetry``), and on other plans as many as fit.
    0: the representatives only."""
    memory_budget_gib: Optional[float] = None
    """Usable memory per device for the OOM filter; default: device memory minus reserved."""
    reroute_restart_s: float = 1.0
    """Time to rebuild process groups and resume after a reroute decision."""
    reparallelize_restart_s: float = 8.0
    """Time to rebuild groups, models and optimizers after a reparallelize decision (transfers excluded)."""
    storage_bandwidth_gb_s: float = 2.0
    """Read bandwidth (GB/s per device) for layers that no survivor holds and come from a checkpoint."""
    checkpoint_restart_penalty_s: float = 1200.0
    """What a checkpoint restart costs (relaunch, load, half a checkpoint interval of lost work).
    Eq. 8 charges it times the chance that the next failure hits a layer's only live holder;
    0 gives the paper's Eq. 8."""
    heartbeat_interval: float = 0.1
    """Seconds between two heartbeats of a worker, a launcher or the controller through the
    store (nvidia-resiliency-ext's name). Shortest of the four timeouts, which must grow in
    this order: heartbeat_interval < heartbeat_timeout < collective_timeout < recovery_timeout."""
    heartbeat_timeout: float = 1.0
    """Seconds without a new heartbeat after which a worker counts as hung (its launcher
    kills it) and a launcher's node as lost (nvidia-resiliency-ext's name). The controller
    counts as gone once its connection closes, or after collective_timeout without a beat
    (workers and launchers then save what they hold and exit, leaving no orphans)."""
    initial_heartbeat_timeout: float = 60.0
    """The heartbeat timeout of a worker that has not yet entered its first plan generation
    (starting up: imports, data, building its stage on a busy node), at least
    heartbeat_timeout; a worker silent that long while starting counts as hung
    (nvidia-resiliency-ext's initial_rank_heartbeat_timeout). A node's launcher gets it too
    until every worker of it has registered (a replacement node starting under load)."""
    collective_timeout: float = 30.0
    """Seconds a collective or point-to-point transfer may wait before it raises (the
    process groups' timeout); longer than heartbeat_timeout, so a hung peer is named by the
    fault detector before the survivors' collectives give up on it."""
    recovery_timeout: float = 120.0
    """Seconds a recovery (decision, group rebuild, transfers, replay) may take before it is
    abandoned; longer than collective_timeout, so a collective stuck inside a recovery
    fails within it and the decision restarts with the new survivors."""
    controller_reattach_s: float = 0.0
    """Seconds the survivors of a lost controller (every other node's launcher and
    workers, their held blocks saved) keep their memory and wait for a restarted one:
    ``odyssey train --resume`` on the controller's node within this window takes them
    back and trains on from their memory with no committed step lost, where they hold
    every block at one committed step (``runtime.control.reattaching``); else it refuses
    them (they exit) and resumes from disk. 0: they exit after their save."""
    profile: Optional[str] = None
    """A profile JSON file (``odyssey profile`` writes one, ``profile_file`` describes it)
    the decision center prices plans with, instead of the analytic profile of
    cluster.device; it must have been measured for this recipe's model, micro-batch size
    and TP size."""
    online_profile: bool = True
    """``odyssey train`` times every op of every step (Megatron's own timer hooks) and
    rescales the profile's forward, backward and optimizer times to what this cluster
    measures (a moving average, ``runtime.control.online_profile``), so decisions after a
    failure price plans with measured times. False: the starting profile throughout."""
    straggler: StragglerAction = StragglerAction.report
    """What ``odyssey train`` does with a straggler, a rank whose ops take over
    ``straggler_slowdown`` times its peers' for ``straggler_steps`` committed steps in a row
    (``runtime.control.stragglers``): report (a console line with its measured slowdown and
    a ``straggler`` event) or remove where removing it pays: the decision center prices the
    current plan with the rank's ops stretched by its slowdown against the plan a failure of
    it would get, that plan's transition included, by Eq. 8 over the same horizon
    (``DecisionCenter.on_straggler``); where removal pays the rank is failed and recovered
    from as any failure, else it trains on, and the line and event give both prices."""
    straggler_slowdown: float = 1.5
    """How many times its peers' op time (per op of its stage's work, against the median
    of its stage's DP peers, or of every rank where its stage has none) makes a rank slow."""
    straggler_steps: int = 5
    """Committed steps in a row a rank must be slow to count as a straggler (a generation's
    first step, which allocates, is not measured)."""
    faults: list[FaultSpec] = field(default_factory=list)
    """Failures to inject, each ``{rank | node, step, phase, action}`` (``FaultSpec``), e.g.
    ``'odyssey.faults=[{rank: 5, step: 2, phase: backward, action: kill}]'``; each fires at
    most once, so a step replayed after recovery runs clean (list a fault twice to fail the
    replay too). Default: none."""
    checkpoint_interval: Optional[int] = None
    """Committed steps between two full checkpoints of a training run (``runtime.checkpoint``:
    RUN_DIR/checkpoint/, keyed by global parameter names, so they load under any layout),
    each copied to host memory as its step starts and written to disk in the background
    while training goes on (``runtime.rank.checkpoint_writer``). A run that loses every
    replica of a block exits 3; ``odyssey train --resume RUN_DIR`` continues from the last
    one. Default (null): Young's interval, sqrt(2 x save time x the job's mean time between
    failures), in steps, the save priced at cluster.disk_write_gb_s; 0: none (recovery in
    memory only)."""
    snapshot_interval: Optional[int] = None
    """Committed steps between two in-memory snapshots (paper 004): each training rank
    copies its share of its stage's state into its node's keeper memory, overlapped with
    the next step, protected by XOR parity across nodes (``snapshot``). When every replica
    of a block dies, the run rolls back to the last snapshot and replays from it instead of
    exiting 3. Default (null): Young's interval, sqrt(2 x snapshot time x the job's mean
    time between failures), in steps; 0: none."""
    snapshot_parity_nodes: int = 4
    """Nodes per parity protection group: each group's snapshots survive the loss of any
    one of its nodes; the parity costs 1/(nodes - 1) of a shard in host memory."""
    restart_workers: int = 0
    """Times a node's launcher starts a worker again after it died (an error, a crash, killed
    as hung) while its node lives on (torchrun's ``--max-restarts``, per rank). The
    restarted worker joins the running job as new capacity: the controller decides by Eq. 8
    whether to grow back onto it, and the next generation hands it its blocks
    (``runtime.control.training_run``). 0: a dead worker stays out of the run."""

    def __post_init__(self) -> None:
        require_plain_numbers("odyssey", self)
        for index, spec in enumerate(self.faults):
            spec.check(f"odyssey.faults[{index}]")
        self.policy = choice("odyssey.policy", Policy, self.policy)
        self.length_sweep = choice("odyssey.length_sweep", LengthSweep, self.length_sweep)
        self.batch_on_failure = choice("odyssey.batch_on_failure", BatchOnFailure, self.batch_on_failure)
        self.straggler = choice("odyssey.straggler", StragglerAction, self.straggler)
        require(self.straggler_slowdown > 1.0, "odyssey.straggler_slowdown",
                f"must be above 1 (a rank that many times slower than its peers is a straggler); "
                f"got {self.straggler_slowdown}")
        require(self.straggler_steps >= 1, "odyssey.straggler_steps",
                f"must be at least 1 (committed steps a rank must be slow in a row); got {self.straggler_steps}")
        require_positive("odyssey", self, "device_mtbf_hours", "max_layer_splits", "storage_bandwidth_gb_s")
        require_non_negative("odyssey", self, "dp_search_radius", "pp_search_radius", "reroute_restart_s",
                             "reparallelize_restart_s", "checkpoint_restart_penalty_s",
                             "prepared_decisions_mib", "restart_workers")
        for interval in ("snapshot_interval", "checkpoint_interval"):
            if getattr(self, interval) is not None:
                require_non_negative("odyssey", self, interval)
        require(self.snapshot_parity_nodes >= 2, "odyssey.snapshot_parity_nodes",
                f"must be >= 2 (parity needs a node beside the one it protects); got {self.snapshot_parity_nodes}")
        require_at_most("odyssey", self, limits.MAX_SEARCH_RADIUS, "candidates grow with the radii",
                        "dp_search_radius", "pp_search_radius")
        require_at_most("odyssey", self, limits.MAX_LAYER_SPLITS, "each is priced", "max_layer_splits")
        require_at_most("odyssey", self, 1000, "a worker that dies a thousand times has a fault of its own",
                        "restart_workers")
        require_at_most("odyssey", self, 2.0**20, "a TiB", "prepared_decisions_mib")
        require_at_most("odyssey", self, limits.MAX_SECONDS, "a year, in seconds", "reroute_restart_s",
                        "reparallelize_restart_s", "checkpoint_restart_penalty_s")
        require(self.device_mtbf_hours >= 1e-3, "odyssey.device_mtbf_hours",
                f"must be >= 0.001 (3.6 s); got {self.device_mtbf_hours}")
        require_at_most("odyssey", self, 1e9, "a hundred thousand years", "device_mtbf_hours")
        require(self.storage_bandwidth_gb_s >= 1e-3, "odyssey.storage_bandwidth_gb_s",
                f"must be >= 0.001 (1 MB/s); got {self.storage_bandwidth_gb_s}")
        require_at_most("odyssey", self, 1e6, "a million GB/s", "storage_bandwidth_gb_s")
        require(self.profile is None or bool(self.profile.strip()), "odyssey.profile",
                "must name a profile JSON file (odyssey profile writes one); got an empty string")
        if self.memory_budget_gib is not None:
            require(self.memory_budget_gib > 0, "odyssey.memory_budget_gib", f"must be > 0, got {self.memory_budget_gib}")
            require_at_most("odyssey", self, 2.0**20, "a PiB per device", "memory_budget_gib")
        require(self.heartbeat_interval >= 0.01, "odyssey.heartbeat_interval",
                f"must be >= 0.01 (10 ms; shorter floods the store); got {self.heartbeat_interval}")
        require(self.controller_reattach_s >= 0, "odyssey.controller_reattach_s",
                f"must be >= 0 seconds (0: survivors of a lost controller exit); got {self.controller_reattach_s}")
        require_at_most("odyssey", self, limits.MAX_SECONDS, "a year, in seconds", *TIMEOUT_ORDER,
                        "initial_heartbeat_timeout", "controller_reattach_s")
        self.timeouts  # checks their order

    @property
    def timeouts(self) -> Timeouts:
        """The runtime's timeouts, shortest first (``odyssey_megatron.timeouts``)."""
        return Timeouts(**{name: getattr(self, name) for name in TIMEOUT_ORDER},
                        initial_heartbeat_timeout=self.initial_heartbeat_timeout,
                        controller_reattach_s=self.controller_reattach_s)

    @property
    def pricing(self) -> Pricing:
        """How plans are priced and run (``settings.Pricing``)."""
        return Pricing(decouple=self.decoupled_weight_grads, staggered=self.staggered_optimizer,
                       distributed_optimizer=self.distributed_optimizer)

    @property
    def search(self) -> SearchSettings:
        """What the planner's search and Eq. 8 read (``settings.SearchSettings``)."""
        return SearchSettings(**{f.name: getattr(self, f.name) for f in fields(SearchSettings) if f.name != "pricing"},
                              pricing=self.pricing)

    @property
    def decisions(self) -> DecisionSettings:
        """What the decision center reads (``settings.DecisionSettings``)."""
        return DecisionSettings(search=self.search, device_mtbf_hours=self.device_mtbf_hours,
                                learn_failure_rate=self.learn_failure_rate,
                                prepared_decisions_mib=self.prepared_decisions_mib)


@dataclass
class RecipeConfig:
    """A whole recipe: what to train, on what, and how Odyssey recovers."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    odyssey: OdysseyConfig = field(default_factory=OdysseyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def __post_init__(self) -> None:
        self._data_parallel_from_world_size()
        par, model, train = self.parallel, self.model, self.training
        require(
            model.num_layers >= par.pipeline_model_parallel_size, "parallel.pipeline_model_parallel_size",
            f"must be <= model.num_layers ({model.num_layers}); got {par.pipeline_model_parallel_size}",
        )
        tp = par.tensor_model_parallel_size
        require(
            model.num_query_groups % tp == 0, "parallel.tensor_model_parallel_size",
            f"must divide model.num_query_groups ({model.num_query_groups}); got {tp}",
        )
        require(
            self.cluster.devices_per_node % tp == 0 or tp % self.cluster.devices_per_node == 0,
            "parallel.tensor_model_parallel_size",
            f"must divide or be a multiple of cluster.devices_per_node ({self.cluster.devices_per_node}); got {tp}",
        )
        per_step = train.micro_batch_size * par.data_parallel_size
        require(
            train.global_batch_size % per_step == 0, "training.global_batch_size",
            f"must be divisible by training.micro_batch_size * parallel.data_parallel_size ({per_step}); "
            f"got {train.global_batch_size}",
        )
        for index, spec in enumerate(self.odyssey.faults):
            spec.check_within(f"odyssey.faults[{index}]", num_ranks=par.num_ranks,
                              devices_per_node=self.cluster.devices_per_node, train_iters=train.train_iters,
                              dedicated_controller=self.cluster.dedicated_controller,
                              snapshot_interval=self.odyssey.snapshot_interval)
        limits.check_plan_size(
            workers=par.pipeline_model_parallel_size * par.data_parallel_size,
            micro_batches=train.num_micro_batches,
            micro_batches_per_pipeline=train.num_micro_batches // par.data_parallel_size,
        )

    def _data_parallel_from_world_size(self) -> None:
        """The data-parallel size from cluster.num_nodes, or else from the launcher's
        WORLD_SIZE, or else from a world of one process (Megatron's ``get_world_size_safe``),
        when the parallel section does not give it; explicit settings win over the
        environment. A given one must match cluster.num_nodes."""
        par, world = self.parallel, self.cluster.world_size
        if world is not None:
            if par.data_parallel_size is None:
                par.derive_data_parallel_size(world, "cluster.num_nodes")
            require(
                world == par.num_ranks, "cluster.num_nodes",
                f"gives a world size of {world} (num_nodes * devices_per_node), but the layout "
                f"tensor_model_parallel_size * pipeline_model_parallel_size * data_parallel_size has {par.num_ranks} ranks",
            )
        elif par.data_parallel_size is None and "WORLD_SIZE" in os.environ:
            text = os.environ["WORLD_SIZE"]
            require(text.strip().isdigit() and int(text) > 0, "WORLD_SIZE", f"must be a positive integer; got {text!r}")
            par.derive_data_parallel_size(int(text), "WORLD_SIZE")
        elif par.data_parallel_size is None:
            model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
            require(
                model_parallel == 1, "cluster.num_nodes",
                "must be given to derive the data-parallel size (world size / (TP * PP), as Megatron does) when "
                "neither parallel.data_parallel_size nor the launcher's WORLD_SIZE is set: the world size is then "
                f"one process, as in Megatron, and TP * PP is {model_parallel}",
            )
            par.derive_data_parallel_size(1, "cluster.num_nodes")


def _model_spec_fields(spec_name: str) -> dict[str, Any]:
    """The architecture named by model.spec: a shipped one, or a Hugging Face Llama
    config.json read with transformers."""
    if not isinstance(spec_name, str):  # YAML reads model.spec=-1 as an int, model.spec=[1] as a list
        raise ConfigError("model.spec", _SPEC_ALLOWED + f"; got {spec_name!r}")
    if spec_name in MODEL_SPECS:
        return dict(MODEL_SPECS[spec_name])
    if not Path(spec_name).exists():
        raise ConfigError("model.spec", _SPEC_ALLOWED + f"; got {spec_name!r}")
    try:
        return read_model_fields(spec_name)
    except ValueError as exc:
        raise ConfigError("model.spec", str(exc)) from None


def _model_spec_layer(recipe: DictConfig, cli: DictConfig) -> list[DictConfig]:
    """The architecture named by model.spec (command line first), under the recipe; and
    num_query_groups equal to the head count when no layer sets it (the schema's default
    was filled in for the default head count)."""
    spec_name = OmegaConf.select(cli, "model.spec") or OmegaConf.select(recipe, "model.spec")
    spec = _model_spec_fields(spec_name) if spec_name is not None else {}
    given = [OmegaConf.select(config, "model") for config in (recipe, cli)]
    layers = [spec] + [OmegaConf.to_container(model) for model in given if isinstance(model, DictConfig)]
    if not any("num_query_groups" in layer for layer in layers):
        heads = next((layer["num_attention_heads"] for layer in reversed(layers) if "num_attention_heads" in layer), None)
        if heads is not None:
            spec["num_query_groups"] = heads
    return [OmegaConf.create({"model": spec})] if spec else []


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                flag: str = "--config") -> tuple[RecipeConfig, Optional[BridgeRecipe]]:
    """Load and validate a recipe, in this layout or Megatron-Bridge's (the overrides in the
    file's); raises ConfigError with a one-line explanation naming the key as the user
    wrote it (``flag`` names the file: the command-line flag or the scenario key). Also
    returns the Bridge reading, whose ``user_error`` names later errors in Bridge's keys
    and whose ``notes`` say what the plugin does not use (the commands print them)."""
    schema = OmegaConf.structured(RecipeConfig)
    loaded, cli = read_layers(path, overrides, flag=flag, schema=schema)
    if "recipe" in loaded and "model" not in loaded:
        raise ConfigError(flag, f"{path} is a simulation scenario (it has recipe: {loaded.get('recipe')}), not a "
                                "recipe; give it to odyssey simulate --scenario, or give its recipe here")
    if not is_bridge_recipe(loaded):
        return build_structured(schema, loaded, cli, defaults=_model_spec_layer), None
    bridge = BridgeRecipe.translate(loaded, cli)
    try:
        config = build_structured(schema, bridge.recipe, OmegaConf.create(), defaults=_model_spec_layer)
    except ConfigError as exc:
        raise bridge.user_error(exc) from None
    return config, bridge


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *, flag: str = "--config") -> RecipeConfig:
    """``load_recipe``'s validated recipe."""
    return load_recipe(path, overrides, flag=flag)[0]


def config_yaml(config: Any) -> str:
    """A loaded config as YAML, with every default and derived value (``--print-config``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def recipe_from_yaml(text: str) -> RecipeConfig:
    """A recipe ``config_yaml`` wrote, already validated: how a training run's resolved
    recipe reaches its workers."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.create(text)))
