"""The model class's log: one logger, and lines said once a process."""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger("vllm.k3_plugin.model")

_said: set[str] = set()


def say_once(line: str) -> None:
    """Log ``line`` once a process, on every rank (vLLM's ``info_once`` logs on the
    first rank only)."""
    if line not in _said:
        _said.add(line)
        logger.info(line)
