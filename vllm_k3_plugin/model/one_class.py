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
may not wait on it in a collective it never joins) or failed first; one that wrote
another entry runs another class or version. Either stops this rank with an error
naming the other rank and, where the launch says, its node; vLLM stops the server.

The check runs once, in ``load_weights``: loaders that never call it
(``--load-format dummy``, ``sharded_state``) start unchecked.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist
from torch import nn
from vllm.config import VllmConfig

from vllm_k3_plugin.envs import MODEL_CLASS_ENV
from vllm_k3_plugin.version import __version__

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
    """Read every other rank's entry, once (a later ``load_weights``, a weight
    reload, checks nothing); raise ``MixedModelClassesError`` naming the first rank
    that built something else, or wrote nothing within ``wait_s`` of this call (a
    model ``announce`` did not see: no check)."""
    written = getattr(model, _ENTRY, None)
    if written is None:
        return
    delattr(model, _ENTRY)
    entry, parallel = written
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    deadline = time.monotonic() + wait_s
    for peer in range(world):
        if peer == rank:
            continue
        key = KEY.format(rank=peer)
        left = max(deadline - time.monotonic(), 0.001)
        try:
            store.wait([key], timedelta(seconds=left))
        except dist.DistStoreError as timeout:
            raise MixedModelClassesError(
                f"Kimi-K3: rank {peer} of {world} ({node_of(peer, world, parallel)}) "
                f"wrote no entry within {wait_s:.0f} s of this rank ({rank}, on "
                f"{socket.gethostname()}) loading its weights: it built another "
                f"class than this plugin's ({entry}), or failed before building "
                "one. Install vllm-k3-plugin on every node and set "
                f"{MODEL_CLASS_ENV} alike on all of them"
            ) from timeout
        theirs, _, host = store.get(key).decode().partition("\n")
        if theirs != entry:
            raise MixedModelClassesError(
                f"Kimi-K3: rank {peer} of {world} ({node_of(peer, world, parallel)}, "
                f"on {host or 'an unknown host'}) built {theirs}, this rank ({rank}) "
                f"{entry}: every node must build the same class (the same "
                f"vllm-k3-plugin installed, {MODEL_CLASS_ENV} set alike)"
            )


def node_of(rank: int, world: int, parallel) -> str:
    """Which node of vLLM's multiprocessing launch runs world rank ``rank``, where
    the launch's flags say: ``--nnodes`` nodes hold equal runs of ranks; data
    parallel over nodes (``--data-parallel-size-local`` below the size, the other
    nodes ``--headless``) runs that many DP ranks a node. Elsewhere (Ray, an
    external load balancer) the node is not known here."""
    nodes = getattr(parallel, "nnodes", 1)
    if nodes > 1:
        per_node = world // nodes
    else:
        local = getattr(parallel, "data_parallel_size_local", None)
        size = getattr(parallel, "data_parallel_size", None) or world
        if (
            getattr(parallel, "distributed_executor_backend", None) == "ray"
            or getattr(parallel, "data_parallel_backend", "mp") == "ray"
            or getattr(parallel, "data_parallel_external_lb", False)
        ):
            return "its node not known"
        if not local or local >= size:
            return "this node"
        per_node = local * parallel.world_size
    if per_node >= world:
        return "this node"
    return f"node {rank // per_node} of {world // per_node}"
