"""DeepSeek Sparse Attention as Kimi-K3.1 puts it on its MLA layers, in plain PyTorch
(the indexer module itself is ``torch_model.Indexer``).

A lightning indexer scores every cached position for each query; the query then
attends only to its ``index_topk`` best positions among those it may see. For query
``t`` and position ``s``, with ``H`` index heads of width ``D``:

    score[t, s] = D^-1/2 H^-1/2 * sum_h w[t, h] * relu(q[t, h] . k[s])

``q = wq_b(q latent)`` (the MLA query latent after its norm), ``k = k_norm(wk(x))``
(one key shared by the heads, kept per position like the MLA latent), ``w =
weights_proj(x)``. K3.1 gives the indexer no positions (``index_rope_dim`` 0). Read
from vLLM 0.34's ``models/kimi_k3/nvidia/dsa.py`` and
``transformers_utils/configs/kimi_linear.py`` (``dsa_config``).
"""

from __future__ import annotations

import torch

from vllm_k3_plugin.reference import reference as ref


def index_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``[T, H, D]`` queries, ``[S, D]`` keys and ``[T, H]`` head weights: the
    ``[T, S]`` scores (fp32)."""
    heads, dim = index_q.shape[1], index_q.shape[2]
    dots = torch.relu(torch.einsum("thd,sd->ths", index_q.float(), index_k.float()))
    scale = dim**-0.5 * heads**-0.5
    return torch.einsum("ths,th->ts", dots, weights.float()) * scale


def _visible_ranked(
    scores: torch.Tensor, past: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[T, S]`` mask of the positions each query may see, and its scores
    (fp32) with the others at ``-inf``."""
    tokens, positions = scores.shape
    visible = ref.causal_mask(tokens, positions, past)
    return visible, scores.float().masked_fill(~visible, float("-inf"))


def causal_topk(scores: torch.Tensor, past: int, topk: int) -> torch.Tensor:
    """``[T, S]`` scores of queries at positions ``past ..`` against positions
    ``0 .. S-1``: the ``[T, S]`` mask of the positions each query attends to, its
    ``topk`` best among those it may see (all of them when it sees fewer). Ties go
    to the earlier position."""
    visible, ranked = _visible_ranked(scores, past)
    positions = scores.shape[1]
    # A stable sort keeps equal scores in position order; hidden positions last.
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    keep = torch.clamp(visible.sum(dim=-1, keepdim=True), max=topk)
    chosen = torch.arange(positions)[None, :] < keep
    selected = torch.zeros_like(visible)
    selected.scatter_(1, order, chosen)
    return selected


def selection_margin(scores: torch.Tensor, past: int, topk: int) -> torch.Tensor:
    """``[T]``: how far each query's selection (``causal_topk``) is from another,
    its ``topk``-th best visible score less the next one; ``inf`` where it sees at
    most ``topk`` positions (it selects them all)."""
    visible, ranked = _visible_ranked(scores, past)
    tokens, positions = scores.shape
    if positions <= topk:
        return torch.full((tokens,), float("inf"))
    best = torch.topk(ranked, topk + 1, dim=-1).values
    margin = best[:, topk - 1] - best[:, topk]
    return torch.where(visible.sum(dim=-1) > topk, margin, float("inf"))


def attend_selected(
    q: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA in its absorbed form over each query's own selection: ``[T, H, C]``
    queries against the ``[T, K, C]`` latent rows each selected (``valid`` ``[T,
    K]`` marks the real ones; each query has at least one). Returns the ``[T, H,
    value_dim]`` outputs over the rows' first ``value_dim`` columns and the ``[T,
    H]`` log-sum-exp, both fp32."""
    rows = rows.float()
    scores = torch.einsum("thc,tkc->thk", q.float(), rows) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("thk,tkc->thc", probs, rows[..., :value_dim]), lse
