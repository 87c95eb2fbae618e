"""Tile sweep of the FP8 latent MoE on a GPU, timed by CUDA-graph replays as
``bench_kernels.py`` times it: K3's shapes on one device (112 experts, top-16,
latent 3584, inner 3072) at 1, 16, 256 and 4,096 tokens; block_m 16 (under 256
tokens) or 64/128, block_n x block_k 64 x 128 and 128 x 128, 4 warps (8 were never
faster in the sweep before), 3 and 4 pipeline stages. Prints the default and the
four fastest per token count, and what the steps around the GEMMs take alone (the
expert grouping, the activations' quantization) next to vLLM's two GEMMs.

    python benchmarks/sweep_moe_tiles.py    # on a CUDA / ROCm GPU; about 3 minutes

``latent_moe.default_tiles`` is set from its output, kept in
``benchmarks/results/moe_tiles_h200.txt``.
"""

from __future__ import annotations

import functools
import itertools
import time

import torch
from bench_kernels import timed

from k3_triton_kernels import latent_moe as moe
from vllm_k3_plugin.model.reference import route

EXPERTS, TOP_K, LATENT, INNER = 112, 16, 3584, 3072


def microseconds(run) -> float:
    return 1e6 * timed(run, warmup=2, repeats=10, cuda=True)


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INNER, LATENT, device=device) / LATENT**0.5
    w2 = torch.randn(EXPERTS, LATENT, INNER, device=device) / INNER**0.5
    packed = moe.fp8_experts_from(w13, w2)
    del w13, w2
    started = time.time()
    for tokens in (1, 16, 256, 4096):
        z = torch.randn(tokens, LATENT, device=device)
        logits = torch.randn(tokens, EXPERTS, device=device)
        weights, ids = route(logits, torch.zeros(EXPERTS, device=device), TOP_K)
        default = moe.default_tiles("fp8", tokens)
        block_ms = (64, 128) if tokens >= 256 else (16,)
        tiles = ((64, 128), (128, 128))
        configs = [(*default, 4, None)]
        configs += [
            (bm, bn, bk, warps, stages)
            for bm, (bn, bk), warps, stages in itertools.product(
                block_ms, tiles, (4,), (3, 4)
            )
        ]
        results = []
        for block_m, block_n, block_k, warps, stages in configs:
            run = functools.partial(
                moe.latent_moe, z, ids, weights, packed, block_m=block_m,
                block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
            )  # fmt: skip
            try:
                us = microseconds(run)
            except Exception as error:  # out of resources: report, go on
                print(f"T={tokens} {block_m}/{block_n}/{block_k}: {error!r:.100}")
                continue
            results.append((us, block_m, block_n, block_k, warps, stages))
        default_us = results[0][0]
        results.sort()
        best = [
            f"{us:.1f} bm{bm} bn{bn} bk{bk} w{w} s{s}"
            for us, bm, bn, bk, w, s in results[:4]
        ]
        grouping = microseconds(
            lambda ids=ids, bm=default[0]: moe.group_by_expert(ids, EXPERTS, bm)
        )
        quantize = microseconds(lambda z=z: moe.quantize_rows(z, moe.FP8))
        try:
            from vllm_baselines import VllmLatentMoe

            vllm = f"{microseconds(VllmLatentMoe(z, ids, weights, packed).gemms):.1f}"
        except Exception as error:  # a baseline that does not run is reported
            vllm = f"failed ({error!r:.80})"
        print(
            f"T={tokens} default={default_us:.1f}us best: {best}; grouping "
            f"{grouping:.1f}us, z quantization {quantize:.1f}us; vLLM GEMMs {vllm}us",
            flush=True,
        )
    print("elapsed", time.time() - started)


if __name__ == "__main__":
    main()
