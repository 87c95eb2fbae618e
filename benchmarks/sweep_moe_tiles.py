"""Tile sweep of the latent MoE kernel on a GPU: for K3's shapes on one device (112
experts, top-16, latent 3584, inner 3072) and 1, 16, 256 and 4,096 tokens, the time of
``latent_moe`` at the old default tiles (block_m 16, 32 x 32, 4 warps) and at
block_n 64/128, block_k 64/128 (32 for MXFP4), 4 and 8 warps, block_m 16 (and 64 from
256 tokens); prints the default and the three fastest per format.

    python benchmarks/sweep_moe_tiles.py    # on a CUDA / ROCm GPU; about 90 s

``benchmarks/results/moe_tiles_h200.txt`` is its output on an H200, from which
``latent_moe.default_tiles`` was set.
"""

from __future__ import annotations

import functools
import itertools
import time

import torch

from k3_triton_kernels import latent_moe as moe
from vllm_k3_plugin.model.reference import route

EXPERTS, TOP_K, LATENT, INNER = 112, 16, 3584, 3072


def microseconds(run, repeats: int) -> float:
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1000


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INNER, LATENT, device=device) / LATENT**0.5
    w2 = torch.randn(EXPERTS, LATENT, INNER, device=device) / INNER**0.5
    packs = {
        "fp8": moe.fp8_experts_from(w13, w2),
        "fp8-block": moe.fp8_block_experts_from(w13, w2),
        "mxfp4": moe.mxfp4_experts_from(w13, w2),
    }
    del w13, w2
    started = time.time()
    for tokens in (1, 16, 256, 4096):
        z = torch.randn(tokens, LATENT, device=device)
        logits = torch.randn(tokens, EXPERTS, device=device)
        weights, ids = route(logits, torch.zeros(EXPERTS, device=device), TOP_K)
        for fmt, packed in packs.items():
            block_ks = (32,) if fmt == "mxfp4" else (64, 128)
            block_ms = (16, 64) if tokens >= 256 else (16,)
            configs = [(16, 32, 32, 4)]
            configs += itertools.product(block_ms, (64, 128), block_ks, (4, 8))
            results = []
            for block_m, block_n, block_k, warps in configs:
                run = functools.partial(
                    moe.latent_moe, z, ids, weights, packed, block_m=block_m,
                    block_n=block_n, block_k=block_k, num_warps=warps,
                )  # fmt: skip
                us = microseconds(run, repeats=3 if tokens == 4096 else 10)
                results.append((us, block_m, block_n, block_k, warps))
            old = results[0][0]
            results.sort()
            best = [
                f"{us:.1f} bm{bm} bn{bn} bk{bk} w{w}"
                for us, bm, bn, bk, w in results[:3]
            ]
            print(f"T={tokens} {fmt} default={old:.1f}us best: {best}", flush=True)
    print("elapsed", time.time() - started)


if __name__ == "__main__":
    main()
