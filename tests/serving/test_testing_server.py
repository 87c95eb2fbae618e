"""The test server's process handling (``tests.support.server``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is
    not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_served_child_dies_with_the_process_that_started_it(tmp_path):
    """A server started for the tests is stopped when the process that started it
    dies by SIGKILL (as a runner's timeout ends it), where no ``finally`` runs:
    here a child started the way ``running_server`` starts ``vllm serve``."""
    pid_file = tmp_path / "child.pid"
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from tests.support.server import die_with_parent\n"
            "child = subprocess.Popen(\n"
            "    [sys.executable, '-c', 'import time; time.sleep(120)'],\n"
            "    start_new_session=True, preexec_fn=die_with_parent,\n"
            ")\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "time.sleep(120)\n",
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the starter never started its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _running(child)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 20
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child)
    finally:
        starter.kill()
