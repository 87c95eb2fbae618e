"""Not a package to import: this folder holds ``k3_triton_kernels``, installed under
that name.

vLLM imports a package named ``triton_kernels``. Where this folder's parent is on
``sys.path`` (Python started in the repository root), ``import triton_kernels`` finds
this file first; it hands over to the real package found further along ``sys.path``,
or fails as if none were installed, so that vLLM falls back to its own copy
(``vllm.third_party.triton_kernels``). Not shipped in the wheel.
"""

import importlib.machinery
import importlib.util
import os
import sys

_OWN = os.path.realpath(__file__)
_FOLDER_PARENT = os.path.dirname(os.path.dirname(_OWN))
# Every entry that reaches this folder, by any spelling (relative, '', a symlink).
_spec = importlib.machinery.PathFinder.find_spec(
    __name__,
    [
        entry
        for entry in sys.path
        if os.path.realpath(entry or os.curdir) != _FOLDER_PARENT
    ],
)
if (
    _spec is None
    or _spec.loader is None
    or os.path.realpath(_spec.origin or "") == _OWN
):
    raise ModuleNotFoundError(
        f"No module named {__name__!r} (the repository's {__name__}/ folder holds "
        "k3_triton_kernels)",
        name=__name__,
    )
_module = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _module
_spec.loader.exec_module(_module)
