"""The import rules between the package's layers (arrows one way).

- ``vllm_k3_plugin.format`` (the output format and its readers) imports the standard
  library and itself only: checked on its source, and by importing every module of it
  in a process where vLLM, torch and the rest of the package cannot be imported.
  ``vllm_k3_plugin.wire`` (Moonshot's wire spec, an ASGI middleware) too, on its
  source.
- ``k3_triton_kernels`` imports nothing of the plugin (the same two checks); of the
  plugin, only ``model/`` and ``reference/`` import the kernels.
- No import circle among the package's modules, function-level imports included.
- The repository's ``triton_kernels/`` folder never stands in for the package of that
  name vLLM imports, whatever the working directory.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "vllm_k3_plugin"
FORMAT = PLUGIN / "format"
KERNELS = ROOT / "triton_kernels" / "k3_triton_kernels"


def run_python(code: str, cwd: Path, env: dict | None = None):
    """``code`` in a fresh interpreter started in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


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


@pytest.mark.parametrize("layer", ["format", "wire"])
def test_the_sans_io_layers_import_the_standard_library_and_themselves_only(layer):
    outside = {}
    for path in sorted((PLUGIN / layer).glob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if name.startswith(f"vllm_k3_plugin.{layer}") or top == "__future__":
                continue
            if top not in sys.stdlib_module_names:
                outside.setdefault(path.name, []).append(name)
    assert not outside, f"vllm_k3_plugin.{layer} imports outside itself: {outside}"


BLOCKED_IMPORT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            # The package's root: its __init__ and the version constant it names.
            inside = name in (
                "vllm_k3_plugin", "vllm_k3_plugin.version"
            ) or name.startswith("vllm_k3_plugin.format")
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
    done = run_python(BLOCKED_IMPORT, ROOT)
    assert done.returncode == 0, done.stderr
    modules = {f"vllm_k3_plugin.format.{path.stem}" for path in FORMAT.glob("*.py")}
    modules = {name.removesuffix(".__init__") for name in modules}
    root = {"vllm_k3_plugin", "vllm_k3_plugin.version"}
    assert set(json.loads(done.stdout)) == root | modules


def _module_name(path: Path, top: Path) -> str:
    parts = path.relative_to(top.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_circles(top: Path) -> list[list[str]]:
    """Each circle of imports among the modules under ``top`` (a package folder),
    as the modules on it. ``from a import b`` imports the module ``a.b`` where
    there is one, else ``a``."""
    modules = {_module_name(path, top): path for path in top.rglob("*.py")}

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.update(
                    owner(f"{node.module}.{alias.name}") for alias in node.names
                )
        edges[name] = targets - {"", name}
    circles, done = [], set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(trail[trail.index(name) :])
            return
        if name in done:
            return
        for target in sorted(edges[name]):
            visit(target, [*trail, name])
        done.add(name)

    for name in sorted(edges):
        visit(name, [])
    return circles


@pytest.mark.parametrize("top", [PLUGIN, KERNELS], ids=["plugin", "kernels"])
def test_no_import_circle(top):
    assert import_circles(top) == []


def test_an_import_circle_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (package / "b.py").write_text("from pkg import a\n")
    assert import_circles(package) == [["pkg.a", "pkg.b"]]


def test_the_kernels_import_nothing_of_the_plugin():
    inward = {
        str(path.relative_to(KERNELS)): sorted(names)
        for path in sorted(KERNELS.rglob("*.py"))
        if (names := {n for n in imported_modules(path) if n.startswith("vllm")})
    }
    assert not inward, f"the kernels import the plugin or vLLM: {inward}"


def test_only_the_model_and_its_reference_import_the_kernels():
    importers = sorted(
        str(path.relative_to(PLUGIN))
        for path in PLUGIN.rglob("*.py")
        if any(name.startswith("k3_triton_kernels") for name in imported_modules(path))
    )
    assert importers
    assert all(path.startswith(("model/", "reference/")) for path in importers), (
        importers
    )


KERNELS_ALONE = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("vllm", "vllm_k3_plugin"):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Blocked())
    import k3_triton_kernels as kernels

    for module in pkgutil.walk_packages(kernels.__path__, "k3_triton_kernels."):
        importlib.import_module(module.name)
    """
)


def test_the_kernels_import_with_the_plugin_and_vllm_unavailable(tmp_path):
    done = run_python(KERNELS_ALONE, tmp_path)
    assert done.returncode == 0, done.stderr


IMPORT_TRITON_KERNELS = "import triton_kernels; print(triton_kernels.__file__)"


def test_the_triton_kernels_folder_hands_over_to_the_installed_package(tmp_path):
    """Started in the repository root (its folders first on ``sys.path``), ``import
    triton_kernels`` gets the installed package, or fails as if none were
    installed: never the repository's folder."""
    installed = tmp_path / "site" / "triton_kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(installed.parent)}
    found = run_python(IMPORT_TRITON_KERNELS, ROOT, env)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == installed / "__init__.py"
    env.pop("PYTHONPATH")
    missing = run_python(IMPORT_TRITON_KERNELS, ROOT, env)
    assert "ModuleNotFoundError" in missing.stderr, missing.stdout
    # The repository reached twice, through a symlink and its real path.
    link = tmp_path / "link"
    link.symlink_to(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([str(link), str(ROOT)])
    twice = run_python(IMPORT_TRITON_KERNELS, tmp_path, env)
    assert "ModuleNotFoundError" in twice.stderr, twice.stderr[-2000:]


VLLM_TRITON_KERNELS = textwrap.dedent(
    """
    import importlib.util, sys
    if importlib.util.find_spec("vllm.third_party.triton_kernels") is None:
        print("no copy")
    else:
        from vllm.utils.import_utils import has_triton_kernels
        assert has_triton_kernels()
        print(sys.modules["triton_kernels"].__file__)
    """
)


def test_vllm_started_in_the_repository_root_finds_its_own_triton_kernels():
    """vLLM prefers an installed ``triton_kernels`` and falls back to its bundled copy
    (0.33); from the repository root it must still reach one of those."""
    done = run_python(VLLM_TRITON_KERNELS, ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    found = done.stdout.strip()
    if found != "no copy":
        assert not found.startswith(str(ROOT / "triton_kernels")), found


# Modules whose job is the request itself (they change it, or name the endpoint).
REQUEST_HOOKS = {"request_hooks.py", "k31_efforts.py", "serving_hooks.py"}


def test_the_reading_path_reads_the_request_in_one_place():
    """The parsers read a request's fields once, into ``RequestFacts``
    (``parsers/request_facts.py``); the request hooks read it for their own job."""
    readers = sorted(
        path.name
        for path in (PLUGIN / "parsers").glob("*.py")
        if "getattr(request" in path.read_text() or "request.tools" in path.read_text()
    )
    assert set(readers) - REQUEST_HOOKS == {"request_facts.py"}
