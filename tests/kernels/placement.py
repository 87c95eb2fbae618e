"""Where the kernel tests put their tensors: the GPU when there is one (the kernels'
own device), else the CPU, where the top conftest runs Triton's interpreter."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in tensors)
