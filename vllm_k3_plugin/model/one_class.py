"""Every rank of a server runs this class, or the server does not start.

The plugin's class is chosen per process (``VLLM_K3_MODEL_CLASS``, and whether the
plugin is installed at all): a node without the plugin, or with another setting,
builds vLLM's in-tree class while the others build ours. The two hold their
tensors and caches differently, and a server made of both would give wrong
answers, or hang in a collective, rather than fail. vLLM never compares the
classes its ranks built.

Each rank that builds the class writes what it built (class, plugin version, host)
into the world process group's key-value store, which every rank of the server
reaches (all nodes, all data-parallel ranks); after loading its weights it reads
every other rank's entry. A rank that wrote nothing within ``PEER_WAIT_S`` built
another class (a rank that builds no model class never writes, and a rank of ours
may not wait on it in a collective it never joins); one that wrote another entry
runs another class or version. Either stops this rank with an error naming the
other rank and its node, and vLLM stops the server.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch import nn
from vllm.config import VllmConfig

from vllm_k3_plugin import __version__
from vllm_k3_plugin.envs import MODEL_CLASS_ENV

KEY = "vllm_k3_plugin/model_class/rank{rank}"
# How long after its own load a rank waits for another's entry. Every rank builds
# its model within seconds of the others (after vLLM's distributed setup, a
# barrier) and writes before loading weights; the wait starts after this rank's
# own load, so only a rank that never builds this class runs it out.
PEER_WAIT_S = 60.0
_ENTRY = "_vllm_k3_world_entry"


class MixedModelClassesError(RuntimeError):
    """Ranks of one server built different model classes."""


def announce(model: nn.Module, vllm_config: VllmConfig) -> None:
    """Write this rank's entry (the top-level class, once it is built)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    built = type(model)
    entry = f"{built.__module__}.{built.__qualname__} (vllm-k3-plugin {__version__})"
    host = socket.gethostname()
    store = dist.distributed_c10d._get_default_store()
    store.set(KEY.format(rank=dist.get_rank()), f"{entry}\n{host}")
    setattr(model, _ENTRY, (entry, vllm_config.parallel_config))


def check_peers(model: nn.Module, wait_s: float = PEER_WAIT_S) -> None:
    """Read every other rank's entry; raise ``MixedModelClassesError`` naming the
    first rank that built something else (a model ``announce`` did not see: no
    check)."""
    written = getattr(model, _ENTRY, None)
    if written is None:
        return
    entry, parallel = written
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    for peer in range(world):
        if peer == rank:
            continue
        key = KEY.format(rank=peer)
        try:
            store.wait([key], timedelta(seconds=wait_s))
        except RuntimeError as timeout:  # torch: DistStoreError, a timeout
            raise MixedModelClassesError(
                f"Kimi-K3: rank {peer} of {world} ({node_of(peer, world, parallel)}) "
                f"did not build this plugin's model class ({entry}) within "
                f"{wait_s:.0f} s of this rank ({rank}, on {socket.gethostname()}) "
                "loading its weights: that node serves another class. Install "
                f"vllm-k3-plugin on every node and set {MODEL_CLASS_ENV} alike on "
                "all of them"
            ) from timeout
        theirs, host = store.get(key).decode().split("\n", 1)
        if theirs != entry:
            raise MixedModelClassesError(
                f"Kimi-K3: rank {peer} of {world} ({node_of(peer, world, parallel)}, "
                f"on {host}) built {theirs}, this rank ({rank}) {entry}: every node "
                "must build the same class (the same vllm-k3-plugin installed, "
                f"{MODEL_CLASS_ENV} set alike)"
            )


def node_of(rank: int, world: int, parallel) -> str:
    """Which node of vLLM's launch runs world rank ``rank``: ``--nnodes`` nodes
    hold equal runs of ranks; with data parallel over nodes, each node runs
    ``--data-parallel-size-local`` DP ranks."""
    nodes = getattr(parallel, "nnodes", 1)
    if nodes > 1:
        per_node = world // nodes
    else:
        local = getattr(parallel, "data_parallel_size_local", None) or world
        per_node = min(world, local * parallel.world_size)
    if per_node >= world:
        return "this node"
    return f"node {rank // per_node} of {world // per_node}"
