"""The shapes ``bench_kernels.py`` times each kernel at (K3's sizes on one device;
with ``smoke``, tiny ones for the CPU interpreter) and the inputs it builds for
them: random experts, and tokens routed over them by the model's router.
"""

from __future__ import annotations


def mla_cases(smoke: bool):
    if smoke:
        return [(2, 64, 16)]
    return [(b, ctx, 16) for b in (1, 32, 128) for ctx in (4096, 32768, 131072)]


# K3's routed experts on one device (896 over EP8): experts, top-k, latent, inner.
K3_MOE = (112, 16, 3584, 3072)


def moe_cases(smoke: bool):
    if smoke:
        return [(4, 8, 2, 64, 32)]
    # tokens, experts, top-k, latent, inner
    return [(t, *K3_MOE) for t in (1, 16, 256, 4096)]


def expert_weights(experts: int, latent: int, inner: int, device):
    """Random fp32 ``(w13 [E, 2I, L], w2 [E, L, I])``, each row of unit scale over
    its inputs, for the MXFP4 experts (and vLLM's FP8 ones) to be built from."""
    import torch

    w13 = torch.randn(experts, 2 * inner, latent, device=device) / latent**0.5
    w2 = torch.randn(experts, latent, inner, device=device) / inner**0.5
    return w13, w2


def routed_tokens(tokens: int, experts: int, top_k: int, latent: int, device):
    """Random ``(z [T, L], ids, weights)``: ``tokens`` latents routed top-k by the
    model's router over random logits."""
    import torch

    from vllm_k3_plugin.reference.reference import route

    z = torch.randn(tokens, latent, device=device)
    logits = torch.randn(tokens, experts, device=device)
    weights, ids = route(logits, torch.zeros(experts, device=device), top_k)
    return z, ids, weights


def kda_cases(smoke: bool):
    if smoke:
        return [(2, 2, 32)]
    # sequences, heads per device (96 over TP8), head dim
    return [(b, 12, 128) for b in (1, 32, 256)]


def kda_prefill_cases(smoke: bool):
    if smoke:
        return [(20, 2, 16)]
    # prompt tokens in one scheduler step, heads per device (96 over TP8), head dim
    return [(t, 12, 128) for t in (2048, 16384)]


def mix_cases(smoke: bool):
    if smoke:
        return [(4, 3, 64)]
    # tokens, sources (stored blocks + the partial sum; at most 9 in K3), hidden
    return [(t, 9, 7168) for t in (1, 64, 8192)]
