"""Checkpoint tensors into the model class's parameters (``load_k3_tensors``): the
BF16 tensors and the MXFP4 expert pairs, checked against the shapes the config
implies (``reference.checkpoint_format``), for the text model and the MTP drafter
alike. A tensor of the wrong shape, an MXFP4 half without its other half or a tensor
the model needs and the checkpoint lacks is an error naming the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from vllm_k3_plugin.model.dsa_vllm import indexer_parameter
from vllm_k3_plugin.model.logs import logger
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.checkpoint_format import (
    MXFP4_SUFFIXES,
    Mxfp4Halves,
    WeightShapeError,
)


class MissingWeightsError(ValueError):
    """Checkpoint tensors the model needs and the checkpoint does not have."""


def load_k3_tensors(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    dense: dict[str, tuple[int, ...]],
    experts: dict[str, tuple[int, int]],
    *,
    elsewhere: set[str] = frozenset(),
    optional: set[str] = frozenset(),
) -> set[str]:
    """Load checkpoint tensors named as ``module``'s parameters: ``dense`` BF16
    tensors and the MXFP4 pairs of ``experts`` (``checkpoint_format``'s shapes),
    skipping ``elsewhere`` (another pipeline stage's); ``optional`` ones of
    ``dense`` may be absent.

    Returns the parameter names loaded. A tensor whose shape differs from the one
    the config implies, an MXFP4 half without its other half, or a tensor the
    model needs and the checkpoint lacks is an error naming the tensor; names the
    model does not know are skipped with one warning.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    loaded_dense: set[str] = set()
    loaded_experts: set[str] = set()
    halves = Mxfp4Halves()
    unknown: list[str] = []
    for name, tensor in weights:
        stem = name.rpartition(".")[0]
        if name in elsewhere or stem in elsewhere:
            continue
        if name.endswith(MXFP4_SUFFIXES):
            if stem not in experts:
                unknown.append(name)
                continue
            pair = halves.add(name, tensor)
            if pair is None:
                continue
            stem, packed, scale = pair
            _check_mxfp4_pair(stem, packed, scale, experts[stem])
            layer, _, tail = stem.rpartition(".experts.")
            expert, proj = tail.split(".")
            moe = module.get_submodule(layer)
            for param_name in moe.load_expert(int(expert), proj, packed, scale):
                loaded.add(f"{layer}.{param_name}")
            loaded_experts.add(stem)
            continue
        elif name in dense:
            _check_shape(name, tensor, dense[name])
        else:
            unknown.append(name)
            continue
        # vLLM's K3.1 indexer (on GPUs) holds the indexer tensors under its names.
        target, shard = (
            (name, None) if name in params else indexer_parameter(name) or (name, None)
        )
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(target)
        loaded_dense.add(name)
    unpaired = halves.unpaired()
    if unpaired is not None:
        raise MissingWeightsError(unpaired)
    missing = sorted(
        ((set(dense) - loaded_dense) | (set(experts) - loaded_experts))
        - elsewhere
        - optional
    )
    if missing:
        raise MissingWeightsError(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
            + ", ".join(missing[:8])
            + (" ..." if len(missing) > 8 else "")
        )
    if unknown:
        logger.warning(
            "Kimi-K3: %d checkpoint tensor(s) not used by the model: %s%s",
            len(unknown),
            ", ".join(unknown[:8]),
            " ..." if len(unknown) > 8 else "",
        )
    return loaded


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise WeightShapeError(
            f"{name}: checkpoint shape {tuple(tensor.shape)}, the config implies "
            f"{tuple(expected)}"
        )


def _check_mxfp4_pair(stem: str, packed, scale, shape) -> None:
    rows, cols = shape
    _check_shape(f"{stem}.weight_packed", packed, (rows, cols // 2))
    _check_shape(f"{stem}.weight_scale", scale, (rows, cols // ref.MXFP4_BLOCK))
