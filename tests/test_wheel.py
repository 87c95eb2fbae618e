"""The built wheel carries every package of the source tree (an editable install
would hide one left out of ``pyproject.toml``), and no test support."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages shipped; triton_kernels/__init__.py (the folder's hand-over to an
# installed triton_kernels) is not one of them.
PACKAGES = (ROOT / "vllm_k3_plugin", ROOT / "triton_kernels" / "k3_triton_kernels")


def source_modules() -> set[str]:
    return {
        "/".join(path.relative_to(package.parent).with_suffix("").parts)
        for package in PACKAGES
        for path in package.rglob("*.py")
    }


def test_the_wheel_holds_every_module(tmp_path):
    # A copy without setuptools' build/ folder, whose stale files would hide a
    # package left out.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", ".ci", "benchmarks"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            tmp_path,
            source,
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name.removesuffix(".py") for name in archive.namelist()}
    missing = sorted(source_modules() - shipped)
    assert not missing, f"left out of the wheel: {missing}"
    # Nothing else: test support stays in tests/.
    tops = {name.split("/")[0] for name in shipped}
    code = {top for top in tops if not top.endswith(".dist-info")}
    assert code == {"vllm_k3_plugin", "k3_triton_kernels"}, sorted(code)
    support = [n for n in shipped if {"testing", "support"} & set(n.split("/"))]
    assert not support, support
