"""Kernel tests run the Triton kernels under the interpreter when no GPU is present.

The interpreter is chosen when a kernel is decorated, so this is set before any kernel
module is imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
