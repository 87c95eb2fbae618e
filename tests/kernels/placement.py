"""Where the kernel tests put their tensors: the GPU when there is one (the kernels'
own device), else the CPU, where the top conftest runs Triton's interpreter."""

from __future__ import annotations

import torch

from k3_triton_kernels.runtime import FP8_DTYPES

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in tensors)


def _gfx94x() -> bool:
    if torch.version.hip is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_properties(0).gcnArchName.startswith("gfx94")


# The FP8 formats the kernels can run here: both under the interpreter;
# e4m3fnuz only on gfx94x, OCP e4m3fn elsewhere (Triton has no fp8e4b8 on NVIDIA).
FNUZ_RUNS_HERE = DEVICE.type == "cpu" or _gfx94x()
OCP_FP8_RUNS_HERE = DEVICE.type == "cpu" or not _gfx94x()
FP8_DTYPES_HERE = [
    dtype
    for dtype in FP8_DTYPES
    if (FNUZ_RUNS_HERE if dtype == torch.float8_e4m3fnuz else OCP_FP8_RUNS_HERE)
]
