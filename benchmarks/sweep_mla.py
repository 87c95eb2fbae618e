"""Launch-configuration sweep of the MLA decode kernel on a GPU (FP8 cache, bf16
queries, 16 heads, 64-token pages), timed by CUDA-graph replays as
``bench_kernels.py`` times it.

1. Tile, pipeline and warps: ``block_n`` x warps 32 x 4, 32 x 8 and 64 x 8 (64 x 4
   was the slowest in both runs before), ``num_stages`` 2/3, each at the default
   split count for its warps and at 1.5x and 2x of it, over four batch x context
   shapes. Prints every configuration's time per shape.
2. Split counts: for the fastest configuration of part 1, split counts from 1 to 3
   per multiprocessor on each shape, against ``default_num_splits``.

    python benchmarks/sweep_mla.py            # on a CUDA / ROCm GPU; about 3 minutes
    python benchmarks/sweep_mla.py --smoke    # one tiny shape, CPU interpreter

``mla_decode``'s defaults (``DEFAULT_BLOCK_N``, ``DEFAULT_STAGES``, the warps,
``default_num_splits``) are set from its output, kept in
``benchmarks/results/mla_sweep_h200.txt``.
"""

from __future__ import annotations

import functools
import itertools
import math
import time

import torch
from kernel_timing import graph_microseconds, script_device

HEADS, PAGE, WIDTH = 16, 64, 576
SHAPES = ((1, 131072), (32, 32768), (128, 32768), (32, 131072))
# --smoke: every configuration once on the CPU interpreter, with a stand-in count
# of multiprocessors for the split counts.
SMOKE_SHAPES = ((2, 100),)
SMOKE_MULTIPROCESSORS = 2


def inputs(batch: int, context: int, device):
    from k3_triton_kernels.mla import decode as k

    pages = math.ceil(context / PAGE)
    cache = torch.randn(batch * pages, PAGE, WIDTH, device=device).to(k.FP8_DTYPES[0])
    table = torch.arange(batch * pages, device=device, dtype=torch.int32)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, 1, HEADS, WIDTH, device=device, dtype=torch.bfloat16)
    return q, cache, table.view(batch, pages), lens


def main(argv=None) -> None:
    device = script_device(__doc__, argv)
    if device.type == "cuda":
        shapes = SHAPES
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        shapes, sms = SMOKE_SHAPES, SMOKE_MULTIPROCESSORS
    sweep(device, shapes, sms)


def sweep(device, shapes, sms: int) -> None:
    from k3_triton_kernels.mla import decode as k

    microseconds = functools.partial(graph_microseconds, cuda=device.type == "cuda")
    started = time.time()
    cases = {shape: inputs(*shape, device) for shape in shapes}
    hbm = {
        shape: shape[0] * shape[1] * WIDTH for shape in shapes
    }  # the FP8 cache bytes

    def default_splits(warps: int) -> dict:
        return {
            shape: k.default_num_splits(shape[1], shape[0], device, warps)
            for shape in shapes
        }

    defaults = default_splits(4)
    print("defaults (splits):", {f"B={b} ctx={c}": s for (b, c), s in defaults.items()})
    results = []
    configs = [
        (block_n, stages, warps)
        for (block_n, warps), stages in itertools.product(
            ((32, 4), (32, 8), (64, 8)), (2, 3)
        )
    ]
    for block_n, stages, warps in configs:
        line = []
        total = 0.0
        splits = default_splits(warps)
        for shape, (q, cache, table, lens) in cases.items():
            best = None
            for factor in (1, 1.5, 2):
                run = functools.partial(
                    k.mla_decode, q, cache, table, lens, max_seq_len=shape[1],
                    num_splits=max(1, round(splits[shape] * factor)),
                    block_n=block_n, num_stages=stages, num_warps=warps,
                )  # fmt: skip
                try:
                    us = microseconds(run)
                except Exception as error:  # out of resources: report, go on
                    print(
                        f"bn{block_n} s{stages} w{warps}: failed, "
                        f"{type(error).__name__}"
                    )
                    us = math.inf
                if best is None or us < best[0]:
                    best = (us, factor)
            total += best[0] / min(1e9, hbm[shape] / 4.8e12 * 1e6)
            tbs = hbm[shape] / best[0] / 1e6
            line.append(
                f"B={shape[0]} ctx={shape[1]} {best[0]:.0f}us x{best[1]} {tbs:.2f}TB/s"
            )
        label = f"bn{block_n} stages{stages} warps{warps}"
        results.append((total, label, (block_n, stages, warps)))
        print(f"{label}: " + "; ".join(line), flush=True)
    results.sort(key=lambda result: result[0])
    _, label, (block_n, stages, warps) = results[0]
    print(f"fastest: {label}", flush=True)
    defaults = default_splits(warps)
    for shape, (q, cache, table, lens) in cases.items():
        most = min(3 * sms, math.ceil(shape[1] / k.MIN_SPLIT_TOKENS))
        counts = sorted({1, 2, 4, 8, 16, 64, sms, 2 * sms, 3 * sms, defaults[shape]})
        timings = []
        for splits in (s for s in counts if s <= most):
            run = functools.partial(
                k.mla_decode, q, cache, table, lens, max_seq_len=shape[1],
                num_splits=splits, block_n=block_n, num_stages=stages,
                num_warps=warps,
            )  # fmt: skip
            timings.append((microseconds(run), splits))
        default_us = dict((s, t) for t, s in timings).get(defaults[shape])
        default_text = "untimed" if default_us is None else f"{default_us:.0f}us"
        timings.sort()
        print(
            f"B={shape[0]} ctx={shape[1]}: default {defaults[shape]} splits "
            f"{default_text}; fastest "
            + ", ".join(f"{s} splits {t:.0f}us" for t, s in timings[:4]),
            flush=True,
        )
    print(f"elapsed {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
