"""The host-read watch the decode-path tests run under: it fails each way of reading
device values on the host, and lets device-only work through."""

from __future__ import annotations

import pytest
import torch

from tests.support.host_reads import HostRead, no_host_reads

T = torch.arange(6.0)

READS = {
    "item": lambda: T[0].item(),
    "int": lambda: int(T.sum()),
    "bool": lambda: bool(T.any()),
    "tolist": lambda: T.tolist(),
    "nonzero": lambda: T.nonzero(),
    "unique": lambda: T.unique(),
    "bincount": lambda: torch.bincount(T.long()),
    "boolean mask read": lambda: T[T > 2],
    "boolean mask write": lambda: T.clone().__setitem__(T > 2, 0.0),
    "uint8 mask read": lambda: T[(T > 2).to(torch.uint8)],
    "repeat_interleave by counts": lambda: T.repeat_interleave(T.long()),
    "equal": lambda: torch.equal(T, T),
    "allclose": lambda: torch.allclose(T, T),
}
DEVICE_ONLY = {
    "arithmetic": lambda: T * 2 + 1,
    "integer index": lambda: T[torch.tensor([1, 3])],
    "scatter_add": lambda: torch.zeros(3).scatter_add_(
        0, torch.tensor([0, 2, 2]), torch.ones(3)
    ),
    "searchsorted": lambda: torch.searchsorted(T, torch.tensor([2.5])),
    "repeat_interleave by an int": lambda: T.repeat_interleave(2),
    "repeat_interleave with its size": lambda: T.repeat_interleave(
        T.long(), output_size=15
    ),
}


@pytest.mark.parametrize("read", list(READS))
def test_each_host_read_is_caught(read):
    with pytest.raises(HostRead), no_host_reads():
        READS[read]()


@pytest.mark.parametrize("work", list(DEVICE_ONLY))
def test_device_only_work_passes(work):
    with no_host_reads():
        DEVICE_ONLY[work]()


def test_tolist_is_restored_after_the_watch():
    with pytest.raises(HostRead), no_host_reads():
        T.tolist()
    assert T.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
