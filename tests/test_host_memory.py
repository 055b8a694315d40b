"""Host memory per node (``estimator.host_memory``): keepers, parity temporaries and
checkpoint staging, counted by hand on a small case, and ``cluster.host_memory_gib``
refusing a plan that needs more, in ``odyssey plan`` (starting and recovery plans) and in
``odyssey train`` before any rank starts."""

from __future__ import annotations

import json
import math

import pytest

from odyssey_megatron.cli import main
from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.estimator.host_memory import HostMemory, host_memory, over_budget
from odyssey_megatron.snapshot.parity import StripeLayout
from odyssey_megatron.snapshot.protection import ENCODE_PIECE_BYTES, ENCODE_WINDOW, encode_temporary_bytes
from odyssey_megatron.units import GIB

TINY = "recipes/llama2_7b/tiny_cpu.yaml"
NPU_32 = "recipes/llama2_7b/ascend_910b_32.yaml"

# Three nodes of one device each, DP 3 x PP 1: every worker holds the whole model.
SMALL = ["model.num_layers=2", "model.hidden_size=8", "model.ffn_hidden_size=16", "model.num_attention_heads=2",
         "model.num_query_groups=2", "model.vocab_size=32", "parallel.pipeline_model_parallel_size=1",
         "parallel.data_parallel_size=3", "training.global_batch_size=6", "training.micro_batch_size=2"]


def _small_center(devices_per_node: int = 1) -> DecisionCenter:
    return DecisionCenter.from_recipe(load_config(TINY, [*SMALL, f"cluster.devices_per_node={devices_per_node}"]))


def test_a_small_plan_needs_the_bytes_counted_by_hand():
    """A block's state is 12 bytes a parameter (fp32 weight and two Adam moments) and an
    8-byte step. Hidden 8, FFN 16, 2 heads of 4, 2 query groups, vocab 32:
      embedding 32*8 = 256 params                                  -> 3,080 B
      a layer   8 + (2+2*2)*4*8 + 8*8 + 8 + 2*16*8 + 8*16 = 656    -> 7,880 B
      output    8 + 32*8 = 264                                     -> 3,176 B
    Shares, largest block first to the least loaded holder (lowest id on ties): layer 0 to
    worker 0, layer 1 to 1, output to 2, then the embedding to 2 (3,176 < 7,880):
    7,880 / 7,880 / 6,256 B. One protection group of the 3 nodes (parity groups of 4):
    chunk ceil(7,880 / 2) = 3,940 B. Per node (one rank each):
      keepers             2 * (share + 3,940): 23,640 / 23,640 / 20,392
      parity temporaries  a spare for the one sender after the first, its whole chunk (under a piece): 3,940
      staging             the share: 7,880 / 7,880 / 6,256"""
    center = _small_center()
    per_node = host_memory(center.plan, center.model, center.cluster, nodes_per_group=4, snapshots=True,
                           checkpoints=True)
    assert per_node == {
        0: HostMemory(keepers=23_640, parity_temporaries=3_940, staging=7_880),
        1: HostMemory(keepers=23_640, parity_temporaries=3_940, staging=7_880),
        2: HostMemory(keepers=20_392, parity_temporaries=3_940, staging=6_256),
    }
    assert per_node[2].total == 30_588


def test_what_a_run_does_not_take_holds_no_host_memory():
    center = _small_center()
    no_checkpoints = host_memory(center.plan, center.model, center.cluster, nodes_per_group=4, snapshots=True,
                                 checkpoints=False)
    assert {node: held.staging for node, held in no_checkpoints.items()} == {0: 0, 1: 0, 2: 0}
    no_snapshots = host_memory(center.plan, center.model, center.cluster, nodes_per_group=4, snapshots=False,
                               checkpoints=True)
    assert no_snapshots == {0: HostMemory(staging=7_880), 1: HostMemory(staging=7_880), 2: HostMemory(staging=6_256)}


def test_a_rank_alone_on_the_only_node_keeps_its_share_twice_and_no_parity():
    center = _small_center(devices_per_node=3)
    per_node = host_memory(center.plan, center.model, center.cluster, nodes_per_group=4, snapshots=True,
                           checkpoints=False)
    assert per_node == {0: HostMemory(keepers=2 * (7_880 + 7_880 + 6_256))}


def test_losing_a_node_leaves_more_on_each_survivor():
    """Node 1 of the 32 NPUs lost: its stage is reparallelized onto 24 devices, whose
    shares grow."""
    center = DecisionCenter.from_recipe(load_config(NPU_32))
    before = host_memory(center.plan, center.model, center.cluster, nodes_per_group=4, snapshots=True,
                         checkpoints=True)
    center.on_failure(nodes=[1])
    after = host_memory(center.plan, center.model, center.cluster, nodes_per_group=4, snapshots=True,
                        checkpoints=True)
    assert sorted(after) == [0, 2, 3]
    assert min(held.total for held in after.values()) > max(held.total for held in before.values())


def test_a_budget_is_filled_keepers_first_and_names_what_does_not_fit():
    per_node = {0: HostMemory(keepers=10, parity_temporaries=5, staging=3), 1: HostMemory(keepers=10, staging=9)}
    assert over_budget(per_node, 19) is None
    assert over_budget(per_node, 18) == (1, ["staging"])
    assert over_budget(per_node, 12) == (1, ["staging"])
    assert over_budget(per_node, 9) == (1, ["keepers", "staging"])
    assert over_budget({0: HostMemory(keepers=10, parity_temporaries=5, staging=3)}, 12) == (
        0, ["parity_temporaries", "staging"])


def test_the_encode_temporaries_are_a_window_of_pieces_in_a_group_of_three_or_more_and_none_in_a_pair():
    assert encode_temporary_bytes(StripeLayout((10, 3, 4)).sizes) == StripeLayout((10, 3, 4)).chunk_bytes == 5
    assert encode_temporary_bytes((10, 3)) == 0
    assert encode_temporary_bytes((4 * 2**30,) * 4) == ENCODE_WINDOW * ENCODE_PIECE_BYTES  # not a 1.33 GiB chunk


def test_odyssey_plan_prints_host_memory_per_node(capsys):
    assert main(["plan", "--config", NPU_32, "cluster.host_memory_gib=200"]) == 0
    out = capsys.readouterr().out
    assert "  host memory per node (of cluster.host_memory_gib=200):" in out
    lines = [line for line in out.splitlines() if line.startswith("    node")]
    assert [line.split(":")[0] for line in lines] == ["    node 0", "    nodes 1-2", "    node 3"]
    assert all(" GiB = keepers " in line and " + parity temporaries " in line and " + checkpoint staging " in line
               for line in lines)
    center = DecisionCenter.from_recipe(load_config(NPU_32))
    node0 = host_memory(center.plan, center.model, center.cluster, nodes_per_group=4, snapshots=True,
                        checkpoints=True)[0]
    assert lines[0] == (f"    node 0: {node0.total / GIB:.2f} GiB = keepers {node0.keepers / GIB:.2f} + parity "
                        f"temporaries {node0.parity_temporaries / GIB:.2f} + checkpoint staging "
                        f"{node0.staging / GIB:.2f} GiB")
    assert main(["plan", "--config", NPU_32, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_memory_bytes"]["0"] == {**node0.parts(), "total": node0.total}
    assert out["host_memory_budget_gib"] is None


def test_odyssey_plan_refuses_a_plan_over_the_budget_in_one_line(capsys):
    assert main(["plan", "--config", NPU_32, "cluster.host_memory_gib=52.2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("odyssey: error: cluster.host_memory_gib: node 3 needs 71.84 GiB of host memory "
                          "(keepers 52.16 + parity temporaries 0.12 + checkpoint staging 19.56 GiB), more than the "
                          "52.2 GiB given: the keepers fit, the parity temporaries and checkpoint staging on top do not")
    assert main(["plan", "--config", NPU_32, "cluster.host_memory_gib=60"]) == 2
    assert "the keepers and parity temporaries fit, the checkpoint staging on top does not" in capsys.readouterr().err


def test_odyssey_plan_checks_the_recovery_plan_it_prints(capsys):
    """100 GiB hold the starting plan's 71.84 GiB a node; once node 1 is lost, the
    survivors' larger shares do not fit."""
    assert main(["plan", "--config", NPU_32, "cluster.host_memory_gib=100"]) == 0
    capsys.readouterr()
    assert main(["plan", "--config", NPU_32, "--failed-nodes", "1", "cluster.host_memory_gib=100"]) == 2
    assert "cluster.host_memory_gib: node 0 needs 105.50 GiB" in capsys.readouterr().err


@pytest.mark.parametrize("value, problem", [("0", "must be > 0"), ("2e6", "must be <= 1,048,576 (a PiB per node)")])
def test_a_bad_host_memory_budget_is_one_line_naming_the_key(value, problem, capsys):
    assert main(["plan", "--config", NPU_32, f"cluster.host_memory_gib={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("odyssey: error: cluster.host_memory_gib: ") and problem in err


def test_odyssey_train_refuses_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    import odyssey_megatron.runtime.control.fork_server as fork_server

    monkeypatch.setattr(fork_server, "start_fork_server", lambda preload: pytest.fail("a worker was about to start"))
    run_dir = tmp_path / "run"
    assert main(["train", "--config", TINY, "--run-dir", str(run_dir), "cluster.host_memory_gib=0.0001"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("odyssey: error: cluster.host_memory_gib: node 0 needs ")
    assert not run_dir.exists()


def test_the_estimate_is_what_the_ranks_allocate_but_the_payloads_alignment():
    """The tiny recipe on 4 nodes of 2: the ranks size their keeper payloads by
    ``shards.shard_bytes`` (each tensor at a multiple of 64 bytes), their parity by
    ``StripeLayout`` over those sizes, and their checkpoint staging buffers as the tensors
    themselves (``shard_entries``' shapes). The estimate, from the blocks' bytes, leaves out
    the payloads' alignment only: 56 bytes of a 1 MB share here."""
    from odyssey_megatron.snapshot.shards import owners, shard_blocks, shard_bytes, shard_entries, snapshot_groups

    config = load_config(TINY, ["cluster.devices_per_node=2"])
    center = DecisionCenter.from_recipe(config)
    plan, cluster, model = center.plan, center.cluster, config.model
    owned = owners(plan, model)
    ranks = {rank: worker for worker in plan.workers for rank in cluster.worker_ranks(worker)}
    payload = {rank: shard_bytes(model, owned, worker, tp_size=1) for rank, worker in ranks.items()}
    tensors = {rank: sum(math.prod(shape) * dtype.itemsize
                         for _, dtype, shape in shard_entries(model, shard_blocks(owned, worker), tp_size=1))
               for rank, worker in ranks.items()}
    allocated: dict[int, list[int]] = {}
    for group in snapshot_groups(plan, cluster=cluster, nodes_per_group=4):
        layout = StripeLayout(tuple(payload[rank] for rank in group))
        for rank in group:
            held = allocated.setdefault(cluster.node_of_rank(rank), [0, 0, 0])
            held[0] += 2 * (payload[rank] + layout.chunk_bytes)
            held[1] += encode_temporary_bytes(layout.sizes)  # what encode allocates (test_snapshot_parity counts it)
            held[2] += tensors[rank]
    estimate = host_memory(plan, model, cluster, nodes_per_group=4, snapshots=True, checkpoints=True)
    assert sorted(estimate) == sorted(allocated) == [0, 1, 2, 3]
    for node, held in estimate.items():
        keepers, temporaries, staging = allocated[node]
        assert held.keepers <= keepers <= held.keepers * 1.001, (node, held, allocated[node])
        assert held.parity_temporaries <= temporaries <= held.parity_temporaries * 1.001, (node, held, allocated[node])
        assert held.staging == staging
