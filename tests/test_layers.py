"""The import rules between the package's layers (arrows one way).

``vllm_k3_plugin.format`` (the output format and its readers) imports the standard
library and itself only: checked on its source, and by importing every module of it
in a process where vLLM, torch and the rest of the package cannot be imported.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMAT = ROOT / "vllm_k3_plugin" / "format"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "vllm_k3_plugin.format":
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_format_core_imports_the_standard_library_and_itself_only():
    outside = {}
    for path in sorted(FORMAT.glob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if name.startswith("vllm_k3_plugin.format") or top == "__future__":
                continue
            if top not in sys.stdlib_module_names:
                outside.setdefault(path.name, []).append(name)
    assert not outside, f"the format core imports outside itself: {outside}"


BLOCKED_IMPORT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            inside = name == "vllm_k3_plugin" or name.startswith(
                "vllm_k3_plugin.format"
            )
            if top in ("vllm", "torch", "triton", "k3_triton_kernels") or (
                top == "vllm_k3_plugin" and not inside
            ):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Blocked())
    import vllm_k3_plugin.format as core

    for module in pkgutil.iter_modules(core.__path__):
        importlib.import_module(f"vllm_k3_plugin.format.{module.name}")
    ours = [name for name in sys.modules if name.startswith("vllm_k3_plugin")]
    print(json.dumps(ours))
    """
)


def test_the_format_core_imports_with_vllm_and_torch_unavailable():
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    modules = {f"vllm_k3_plugin.format.{path.stem}" for path in FORMAT.glob("*.py")}
    modules = {name.removesuffix(".__init__") for name in modules}
    assert set(json.loads(done.stdout)) == {"vllm_k3_plugin", *modules}
