"""Print the installed vLLM's requirements that a CPU machine can use, one a line.

vLLM's CUDA wheel declares its GPU stack (torch's CUDA build and its media
libraries, FlashInfer, CUTLASS, TileLang and other kernel packages) as plain
requirements. Installed with ``--no-deps``, its Python layers above the engine core
import on CPU torch without them; this lists everything else it declares, with its
markers applied, for pip to install.
"""

from __future__ import annotations

import re
from importlib.metadata import distribution

# Requirements that are the GPU or media stack (or torch itself, which the caller
# pins to the CPU build).
GPU_STACK = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|triton|pynvvideocodec"
    r"|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-.*|nvtx|fastsafetensors"
    r"|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels)$"
)


def cpu_requirements(dist_name: str = "vllm") -> list[str]:
    from packaging.requirements import Requirement

    kept = []
    for line in distribution(dist_name).requires or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(
            {"extra": ""}
        ):
            continue
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if GPU_STACK.match(name):
            continue
        requirement.marker = None
        kept.append(str(requirement))
    return kept


if __name__ == "__main__":
    print("\n".join(cpu_requirements()))
