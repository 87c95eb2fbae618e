"""Every rank runs the plugin's class, or the server stops (``model.one_class``):
two real ranks of a gloo world (two processes, the store vLLM's world group
uses), the second building the same class, no class of ours, or another one.
The served case, a node of a two-node launch building another class, is
``test_vllm_model_nodes.py::test_a_node_with_another_class_stops_the_server``."""

from __future__ import annotations

import multiprocessing
import types

import pytest
from torch import nn

from tests.support.server import free_port

WAIT_S = 3.0


class KimiK3ForConditionalGeneration(nn.Module):
    pass


class SomeoneElsesK3(nn.Module):
    pass


def _rank(rank: int, port: int, second: str, results) -> None:
    import torch.distributed as dist

    from vllm_k3_plugin.model import one_class

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank
    )
    parallel = types.SimpleNamespace(
        nnodes=2, world_size=1, data_parallel_size=1, data_parallel_size_local=None
    )
    config = types.SimpleNamespace(parallel_config=parallel)

    built = KimiK3ForConditionalGeneration()
    if rank == 1 and second == "another class":
        built = SomeoneElsesK3()
    if rank == 0 or second != "no class of ours":
        one_class.announce(built, config)
    try:
        one_class.check_peers(built, wait_s=WAIT_S)
        results.put((rank, "ok"))
    except one_class.MixedModelClassesError as error:
        results.put((rank, str(error)))


def _run(second: str) -> dict[int, str]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_rank, args=(rank, port, second, results))
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    said = dict(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    return said


def test_the_same_class_everywhere_serves():
    assert _run("the same class") == {0: "ok", 1: "ok"}


def test_a_rank_without_our_class_is_named():
    said = _run("no class of ours")
    assert said[0].startswith(
        "Kimi-K3: rank 1 of 2 (node 1 of 2) wrote no entry within 3 s of this rank"
    ), said[0]
    assert (
        f"another class than this plugin's ({__name__}.KimiK3ForConditionalGeneration "
        "(vllm-k3-plugin "
    ), said[0]
    # A rank that built no class of ours checks nothing.
    assert said[1] == "ok"


def test_another_class_is_named_on_both_sides():
    said = _run("another class")
    assert "rank 1 of 2 (node 1 of 2, on " in said[0]
    assert f"built {__name__}.SomeoneElsesK3 (vllm-k3-plugin" in said[0], said[0]
    assert "rank 0 of 2 (node 0 of 2, on " in said[1]
    assert f"built {__name__}.KimiK3ForConditionalGeneration" in said[1], said[1]


@pytest.mark.parametrize(
    ("flags", "world", "rank", "node"),
    [
        ({"nnodes": 2, "world_size": 2}, 4, 3, "node 1 of 2"),  # TP=2, --nnodes 2
        (  # DP=2, one DP rank a node
            {"world_size": 1, "data_parallel_size": 2, "data_parallel_size_local": 1},
            2,
            1,
            "node 1 of 2",
        ),
        (  # DP=2 x TP=2 on one node
            {"world_size": 2, "data_parallel_size": 2, "data_parallel_size_local": 2},
            4,
            3,
            "this node",
        ),
        ({"world_size": 2}, 2, 1, "this node"),  # TP=2, one node
        (  # Ray places ranks on nodes itself
            {"world_size": 2, "distributed_executor_backend": "ray"},
            2,
            1,
            "its node not known",
        ),
        (  # an external load balancer: one DP rank an engine, wherever it runs
            {
                "world_size": 1,
                "data_parallel_size": 2,
                "data_parallel_size_local": 1,
                "data_parallel_external_lb": True,
            },
            2,
            1,
            "its node not known",
        ),
    ],
)
def test_the_node_of_a_rank(flags, world, rank, node):
    from vllm_k3_plugin.model.one_class import node_of

    defaults = {
        "nnodes": 1,
        "data_parallel_size": 1,
        "data_parallel_size_local": None,
        "distributed_executor_backend": "mp",
        "data_parallel_backend": "mp",
        "data_parallel_external_lb": False,
    }
    parallel = types.SimpleNamespace(**{**defaults, **flags})
    assert node_of(rank, world, parallel) == node
