"""How the GPU scripts time a call (``bench_kernels.py``, the sweeps): device time
from CUDA-graph replays (``timed``, ``graph_microseconds``), wall time of eager
calls with their launches (``wall_timed``), a call's time per GPU kernel
(``kernel_microseconds``), and the device a script runs on (``script_device``: the
GPU, or with ``--smoke`` the CPU and the Triton interpreter).
"""

from __future__ import annotations

import argparse
import os
import time

GRAPH_CALLS = 10
# Why each capture since the last row was printed failed: that row's ratio may then
# set an uncaptured time (launches included) against a captured one, and says so.
UNCAPTURED: list[str] = []


def timed(run, *, warmup: int, repeats: int, cuda: bool) -> float:
    """Median seconds of ``run()`` on the device, without the cost of launching it:
    on a GPU, replays of a CUDA graph of ``GRAPH_CALLS`` calls (the memory a call
    frees is reused by the next inside the graph), each replay timed by events; a
    call that cannot be captured (a host read) runs ``GRAPH_CALLS`` times back to
    back between events instead, and the reason joins ``UNCAPTURED``. On the CPU,
    wall time of single calls."""
    import torch

    for _ in range(max(1, warmup)):  # at least one: no compile inside a capture
        run()
    if not cuda:
        return wall_timed(run, warmup=0, repeats=repeats, cuda=False)
    torch.cuda.synchronize()
    replay = _captured(run)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(max(1, repeats // 2)):
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / GRAPH_CALLS)
    samples.sort()
    return samples[len(samples) // 2]


def _captured(run):
    """A callable that makes ``GRAPH_CALLS`` calls of ``run``: a graph's replay, or
    the calls themselves when ``run`` cannot be captured."""
    import torch

    def calls():
        for _ in range(GRAPH_CALLS):
            run()

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            calls()
    except Exception as error:  # a host read in the call: time it uncaptured
        torch.cuda.synchronize()
        UNCAPTURED.append(f"{type(error).__name__}: {error}"[:100])
        return calls
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph.replay


def graph_microseconds(run, cuda: bool = True) -> float:
    """``run``'s device time on a GPU in microseconds, as the sweeps and the
    comparison of options take it: CUDA-graph replays, 2 warm-up calls, 10 timed.
    Off a GPU (the scripts' ``--smoke`` runs on the interpreter), the wall time of
    one call after one to compile: the plumbing runs, the figure means nothing."""
    if not cuda:
        return 1e6 * timed(run, warmup=1, repeats=1, cuda=False)
    return 1e6 * timed(run, warmup=2, repeats=10, cuda=True)


def script_device(doc: str, argv=None):
    """The device a GPU script runs on, from its command line: the GPU, or with
    ``--smoke`` the CPU, the kernels on the Triton interpreter (set here, before
    the kernels' modules import Triton)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU interpreter"
    )
    smoke = parser.parse_args(argv).smoke
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    return torch.device("cpu" if smoke else "cuda")


def kernel_microseconds(run, calls: int = 5) -> dict[str, float]:
    """Device microseconds a call of ``run`` spends in each GPU kernel, by name, as
    the PyTorch profiler records them over ``calls`` eager calls (after one to
    compile), longest first: where a launcher's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    synchronize = torch.cuda.synchronize if cuda else lambda: None
    # Off a GPU (``--smoke``) the profiler records the CPU, where the interpreter's
    # launches are no kernels: the result is empty, the code path the same.
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    run()
    synchronize()
    with profile(activities=[activity]) as recorded:
        for _ in range(calls):
            run()
        synchronize()
    totals: dict[str, float] = {}
    for event in recorded.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:  # older PyTorch
            device_us = event.cuda_time_total
        # Kernels only: an operator's device time is its kernels' again.
        if device_us > 0 and event.count > 0 and not event.key.startswith("aten::"):
            totals[event.key] = totals.get(event.key, 0.0) + device_us / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def wall_timed(run, *, warmup: int, repeats: int, cuda: bool) -> float:
    """Median wall seconds of single calls, the launch included (what an eager
    scheduler step pays)."""
    import torch

    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]
