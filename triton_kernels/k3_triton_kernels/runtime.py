"""Where the Triton kernels can run, and one log line per kernel and path: which
implementation a launcher took, and why not the Triton kernel when it did not."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

logger = logging.getLogger("vllm.k3_plugin.kernels")
_said: set[tuple[str, str]] = set()


def interpreted() -> bool:
    """Triton kernels run on its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(device: torch.device) -> bool:
    """Triton runs on a GPU, or anywhere under ``TRITON_INTERPRET=1``."""
    return interpreted() or device.type == "cuda"


def triton_blocker(device: torch.device) -> str | None:
    """Why no Triton kernel can run on ``device``, or ``None``."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not triton_usable(device):
        return f"no Triton backend for device {device.type}"
    if interpreted():
        _interpreter_scalars_index_under_any_numpy()
    return None


_index_fixed = False


def _interpreter_scalars_index_under_any_numpy() -> None:
    """Triton's interpreter before 3.7 holds a scalar as a one-element array and
    gives ``range()`` its ``int(array)``, which NumPy 2.4 refuses (only 0-d arrays
    convert): a kernel's loop over loaded bounds then fails. Triton 3.7 on takes
    the element first, as this does; set within the same per-launch patch scope."""
    global _index_fixed
    if _index_fixed:
        return
    _index_fixed = True
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def patch_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        # ``.item()``: a one-element array of any rank; more elements raise.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_with_scalar_index


if interpreted() and importlib.util.find_spec("triton") is not None:
    # Every kernel module imports this one: the patch is in before any launch,
    # whichever launcher (or kernel helper) runs first.
    _interpreter_scalars_index_under_any_numpy()


# The e4m3 flavours the kernels read, by exponent bias: OCP e4m3fn (MI355X, CUDA)
# and gfx94x's e4m3fnuz. Every per-flavour constant of the kernels derives from it.
E4M3_EXPONENT_BIAS = {torch.float8_e4m3fn: 7, torch.float8_e4m3fnuz: 8}
FP8_DTYPES = tuple(E4M3_EXPONENT_BIAS)
# Each flavour's NaN byte (fnuz has no negative zero: 0x80 is its NaN).
E4M3_NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e4m3fnuz: 0x80}


# The chunked KDA kernels hold C x C and C x K tiles in registers: at 32 tokens a
# chunk they spill on sm90 (8 KB of stack at 4 warps, 640 B at 8), so the model runs
# them on chunks of at most 16.
CHUNKED_KDA_MAX_CHUNK = 16


def on_rocm() -> bool:
    """The launchers' target is an AMD GPU (a ROCm build of PyTorch)."""
    return torch.version.hip is not None


def num_warps(*, nvidia: int, amd: int) -> int:
    """A launch's warps for the platform: the register budgets differ (sm90: 255
    registers a thread; CDNA: up to 512 VGPRs a lane at 4 wavefronts of 64)."""
    return amd if on_rocm() else nvidia


def chunked_kda_tile_blocker(chunk: int, key_dim: int, value_dim: int) -> str | None:
    """Why the chunked KDA prefill kernels cannot tile these dims (``tl.dot`` takes
    powers of two ≥ 16; value columns are masked), or ``None``."""

    def tiles(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    if not tiles(chunk):
        return f"chunk length {chunk} (the gate's lower bound) is not a power of 2 ≥ 16"
    if chunk > CHUNKED_KDA_MAX_CHUNK:
        return f"chunk length {chunk} is over {CHUNKED_KDA_MAX_CHUNK} (register tiles)"
    if not tiles(key_dim):
        return f"key head dim {key_dim} is not a power of 2 ≥ 16"
    if value_dim < 16:
        return f"value head dim {value_dim} is under 16"
    return None


def log_path(kernel: str, fallback_reason: str | None) -> None:
    """``fallback_reason`` ``None``: the Triton kernel runs."""
    line = (
        "Triton kernel"
        if fallback_reason is None
        else f"PyTorch path ({fallback_reason})"
    )
    if (kernel, line) in _said:
        return
    _said.add((kernel, line))
    logger.info("%s: %s", kernel, line)
