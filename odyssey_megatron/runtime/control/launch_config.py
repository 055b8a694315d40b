"""Where this node sits in the job, in torchrun's names: ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port`` (or the ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` environment variables a scheduler sets) and ``--nproc-per-node``. Under
SLURM (one ``odyssey train`` per node, started by ``srun``) the node count, the node's
index and the master host come from SLURM's own variables when torchrun's are absent:
``SLURM_NNODES``, ``SLURM_NODEID`` and the first host of ``SLURM_JOB_NODELIST``. SLURM
names no port: the job script sets ``MASTER_PORT``.

A flag given wins over its environment variable, which wins over SLURM's, which wins over
the default; an error names whichever the bad value came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

from odyssey_megatron import limits
from odyssey_megatron.errors import ConfigError

__all__ = ["LAUNCH_FLAGS", "SLURM_VARIABLES", "LaunchConfig", "first_host"]

LAUNCH_FLAGS = {
    "nnodes": ("--nnodes", "NNODES"),
    "node_rank": ("--node-rank", "NODE_RANK"),
    "master_addr": ("--master-addr", "MASTER_ADDR"),
    "master_port": ("--master-port", "MASTER_PORT"),
    "nproc_per_node": ("--nproc-per-node", None),
}
"""Field -> (flag, environment variable or None)."""
SLURM_VARIABLES = {"nnodes": "SLURM_NNODES", "node_rank": "SLURM_NODEID", "master_addr": "SLURM_JOB_NODELIST"}
"""Field -> the SLURM variable read when neither the flag nor torchrun's variable is given."""
_NODELIST = re.compile(r"([^,\[\]]+)(?:\[([^\]]+)\]([^,\[\]]*))?(?:,|$)")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as ``scontrol show hostnames`` would list it
    (``gpu[07-09,12],login1`` -> ``gpu07``); ValueError if it is not one."""
    match = _NODELIST.match(nodelist.strip())
    if match is None:
        raise ValueError(f"is not a SLURM node list (host[01-04],other); got {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first:
        raise ValueError(f"is not a SLURM node list (host[01-04],other); got {nodelist!r}")
    return f"{prefix}{first}{suffix}"


@dataclass(frozen=True)
class LaunchConfig:
    nnodes: int = 1
    node_rank: int = 0
    """This node, 0 .. nnodes-1; node 0 also runs the controller."""
    master_addr: str = "127.0.0.1"
    """Where node 0's controller hosts the store: the only address it binds (loopback by default)."""
    master_port: int = 0
    """The store's port; 0 lets node 0 pick a free one (one node only: the others could not know it)."""
    nproc_per_node: int = 1
    """Worker processes a node with workers starts (one per device)."""
    dedicated_controller: bool = False
    """Node 0 runs the controller and its store only, no workers, so the run's one central
    process can sit on a host of its own (a CPU node) that no device failure takes down;
    the workers' nodes are 1 .. nnodes-1 (``cluster.dedicated_controller``)."""

    @property
    def first_worker_node(self) -> int:
        """The first node with workers: the decision center's node 0."""
        return 1 if self.dedicated_controller else 0

    @property
    def world_size(self) -> int:
        return (self.nnodes - self.first_worker_node) * self.nproc_per_node

    @property
    def ranks(self) -> range:
        """This node's ranks, ``nproc_per_node`` of them, numbered over the workers' nodes."""
        if self.node_rank < self.first_worker_node:
            return range(0)
        first = (self.node_rank - self.first_worker_node) * self.nproc_per_node
        return range(first, first + self.nproc_per_node)

    @classmethod
    def resolve(cls, flags: Mapping[str, Optional[str]], environ: Mapping[str, str], *,
                dedicated_controller: bool = False) -> "LaunchConfig":
        """From flag values as typed (``flags[field]``, None or absent when not given) and
        the environment; ``dedicated_controller`` from the recipe."""
        values, sources = {}, {}
        for name, (flag, env) in LAUNCH_FLAGS.items():
            slurm = SLURM_VARIABLES.get(name)
            if flags.get(name) is not None:
                values[name], sources[name] = flags[name], flag
            elif env is not None and env in environ:
                values[name], sources[name] = environ[env], env
            elif slurm is not None and slurm in environ:
                values[name], sources[name] = environ[slurm], slurm
            else:
                sources[name] = flag
        if sources["master_addr"] == SLURM_VARIABLES["master_addr"]:
            try:
                values["master_addr"] = first_host(values["master_addr"])
            except ValueError as exc:
                raise ConfigError(sources["master_addr"], str(exc)) from None

        def integer(name: str, low: int, high: int) -> int:
            text = values[name]
            try:
                value = int(text)
            except ValueError:
                raise ConfigError(sources[name], f"must be an integer; got {text!r}") from None
            if not low <= value <= high:
                raise ConfigError(sources[name], f"must lie in {low}..{high}; got {value}")
            return value

        fields = {}
        if "nnodes" in values:
            fields["nnodes"] = integer("nnodes", 1, limits.MAX_WORKERS)
        nnodes = fields.get("nnodes", cls.nnodes)
        if "node_rank" in values:
            fields["node_rank"] = integer("node_rank", 0, nnodes - 1)
        if "nproc_per_node" in values:
            fields["nproc_per_node"] = integer("nproc_per_node", 1, limits.MAX_DEVICES_PER_NODE)
        if "master_port" in values:
            fields["master_port"] = integer("master_port", 0, 65535)
        if "master_addr" in values:
            addr = values["master_addr"]
            if not addr or any(c.isspace() for c in addr):
                raise ConfigError(sources["master_addr"], f"must be a host name or IP address; got {addr!r}")
            fields["master_addr"] = addr
        if nnodes > 1 and fields.get("master_port", 0) == 0:
            raise ConfigError(sources["master_port"], f"must name a port (not 0) when there are {nnodes} nodes: "
                                                      "the others cannot learn one that node 0 picks")
        if dedicated_controller and nnodes < 2:
            raise ConfigError("cluster.dedicated_controller", f"needs the controller's node and at least one node "
                                                              f"with workers (--nnodes 2 or more); got {nnodes} node")
        return cls(**fields, dedicated_controller=dedicated_controller)
