"""The package as published: ``python -m build`` makes an sdist and a wheel without
warnings, ``twine check`` passes them, both carry the licence, and the wheel every
package of the source tree (an editable install would hide one left out of
``pyproject.toml``) and no test support."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel ``python -m build`` makes (the wheel from the sdist,
    as a publisher's upload is built), and what the build printed."""
    tmp = tmp_path_factory.mktemp("build")
    # A copy without setuptools' build/ folder, whose stale files would hide a
    # package left out, and without the test environments.
    source = tmp / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".ci", "benchmarks"
        ),
    )
    dist = tmp / "dist"
    # Without PYTHONDONTWRITEBYTECODE, which makes setuptools warn that it skips
    # byte-compiling: the environment's choice, not the package's.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    run = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", dist, source],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "log": run.stdout + run.stderr}


def test_the_build_says_no_warning(built):
    warned = [line for line in built["log"].splitlines() if "warn" in line.lower()]
    assert not warned, "\n".join(warned)


def test_twine_passes_the_distributions(built):
    run = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict",
         built["wheel"], built["sdist"]],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("PASSED") == 2, run.stdout


def test_the_licence_ships_in_both(built):
    with zipfile.ZipFile(built["wheel"]) as archive:
        names = archive.namelist()
        licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert b"Apache License" in archive.read(licence)
    assert "vllm_k3_plugin/data/LICENSE.KVV" in names
    with tarfile.open(built["sdist"]) as archive:
        assert any(name.endswith("/LICENSE") for name in archive.getnames())


def test_the_wheel_holds_every_module(built):
    with zipfile.ZipFile(built["wheel"]) as archive:
        shipped = {name.removesuffix(".py") for name in archive.namelist()}
    missing = sorted(source_modules() - shipped)
    assert not missing, f"left out of the wheel: {missing}"
    # Nothing else: test support stays in tests/.
    tops = {name.split("/")[0] for name in shipped}
    code = {top for top in tops if not top.endswith(".dist-info")}
    assert code == {"vllm_k3_plugin", "k3_triton_kernels"}, sorted(code)
