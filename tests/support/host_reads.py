"""Catch reads of device values on the host: what makes a GPU step wait for the
device (a sync) and what a CUDA graph cannot capture.

``no_host_reads()`` fails the first operation that needs a tensor's values on the
host: ``.item()``, ``int()``, ``float()``, ``bool()``, ``.tolist()``, ``torch.equal``
and ``allclose``, a copy to the CPU of a tensor that is elsewhere, and the ops whose
output size depends on the values (``nonzero``, ``unique``, boolean masks read or
written, ``repeat_interleave`` by a tensor of counts without an output size,
``bincount``, whose length is the largest value). It works on the CPU too, so the GPU
paths' host reads are found where the tests run; a ``.cpu()`` or ``.numpy()`` of a
CPU tensor is no read there, and goes unseen. Nor is anything inside a registered
custom op (vLLM's ``torch.ops.vllm.*``): the mode is off the dispatch stack while
it dispatches one, so the op's body runs unwatched (``.tolist()`` alone, patched on
the tensor class, is still caught there).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ_OPS = {
    "aten._local_scalar_dense",  # .item(), int(), float(), bool()
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.repeat_interleave",
    "aten.bincount",
    "aten.equal",
    "aten.allclose",
}


class HostRead(AssertionError):
    pass


class HostReadWatch(TorchDispatchMode):
    """The watch ``no_host_reads`` keeps; while ``active`` is false it lets every
    operation through (a stand-in graph capture's eager breaks)."""

    def __init__(self, active: bool = True) -> None:
        super().__init__()
        self.active = active

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        sized_repeat = name == "aten.repeat_interleave" and (
            func._overloadname == "self_int" or kwargs.get("output_size") is not None
        )
        if name in HOST_READ_OPS and not sized_repeat:
            raise HostRead(f"{name} reads device values on the host")
        if name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            index is not None and index.dtype in (torch.bool, torch.uint8)
            for index in args[1]
        ):
            raise HostRead("a boolean mask index reads device values on the host")
        if name == "aten.copy_" and args[0].device.type == "cpu" != args[1].device.type:
            raise HostRead(f"a copy from {args[1].device} into a CPU tensor")
        if name == "aten._to_copy" and kwargs.get("device") is not None:
            source, target = args[0].device, torch.device(kwargs["device"])
            if target.type == "cpu" and source.type != "cpu":
                raise HostRead(f"a copy from {source} to the CPU")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_reads(watch: HostReadWatch | None = None):
    """Fail host reads in the block (while ``watch``, if given, is active)."""
    watch = watch if watch is not None else HostReadWatch()
    original_tolist = torch.Tensor.tolist

    def tolist(self):
        if watch.active:
            raise HostRead(".tolist() reads device values on the host")
        return original_tolist(self)

    torch.Tensor.tolist = tolist
    try:
        with watch:
            yield watch
    finally:
        torch.Tensor.tolist = original_tolist
