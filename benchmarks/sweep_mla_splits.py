"""KV split counts of the MLA decode on a GPU: for 16 heads at 128k tokens, one and
32 sequences, the time of ``mla_decode`` at several split counts and at the default
(``mla_decode.default_num_splits``).

    python benchmarks/sweep_mla_splits.py    # on a CUDA / ROCm GPU

The figures in ``default_num_splits``' docstring (one sequence: 264 splits 240 µs, 128
splits 183 µs; 32 sequences: 9 splits 5751 µs, 4 splits 4316 µs) were measured on an
H200 by a review helper's one-off script of this shape; this script has not run yet.
"""

from __future__ import annotations

import functools
import math

import torch

from k3_triton_kernels import mla_decode as k

HEADS, CONTEXT, PAGE = 16, 131072, 64


def microseconds(run, repeats: int = 20) -> float:
    for _ in range(3):
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
    pages = math.ceil(CONTEXT / PAGE)
    for batch in (1, 32):
        cache = torch.randn(batch * pages, PAGE, 576, device=device).to(k.FP8_DTYPES[0])
        table = torch.arange(batch * pages, device=device, dtype=torch.int32)
        table = table.view(batch, pages)
        lens = torch.full((batch,), CONTEXT, device=device, dtype=torch.int32)
        q = torch.randn(batch, 1, HEADS, 576, device=device, dtype=torch.bfloat16)
        default = k.default_num_splits(CONTEXT, batch, device)
        for splits in sorted({1, 4, 9, 16, 64, 128, 132, 264, default}):
            run = functools.partial(
                k.mla_decode, q, cache, table, lens, max_seq_len=CONTEXT,
                num_splits=splits,
            )  # fmt: skip
            mark = " (default)" if splits == default else ""
            print(f"B={batch} splits={splits}{mark}: {microseconds(run):.1f} us")
        del cache


if __name__ == "__main__":
    main()
