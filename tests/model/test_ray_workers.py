"""The plugin in a Ray worker on another node, as vLLM 0.32's older Ray executor
(``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) starts one.

vLLM's Ray executors refuse the CPU platform (``ray_device_key`` is empty: "current
platform cpu does not support ray"), so no Ray server runs here. What a Ray launch
asks of the plugin is checked where it happens: a local two-node Ray cluster (two
raylets on this host), vLLM's Ray worker wrapper (``RayWorkerWrapper``) placed on
the second node, given the environment vLLM copies from the head
(``get_env_vars_to_copy``: its own variables and every ``VLLM_``-prefixed one) and
initialised with a real engine config of the tiny K3 checkpoint, as vLLM's
executor does. There vLLM loads the general plugins: the ``kimi_k3`` parsers and
the K3 architectures resolve to the plugin's, and a ``VLLM_K3_*`` setting given
only on the head reached it.

Needs Ray (``scripts/test_multinode.sh`` installs it); marked ``multinode``.
"""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = [pytest.mark.multinode]

ray = pytest.importorskip("ray", reason="Ray: scripts/test_multinode.sh installs it")

SECOND_NODE = "k3_second_node"
# A setting the head sets and the second node's environment lacks.
HEAD_ONLY_SETTING = ("VLLM_K3_REPLAY_POLICY", "hold-back")


def _what_the_worker_sees(worker):
    """Run in the Ray worker on the second node, through vLLM's ``execute_method``."""
    import os

    import ray
    from vllm import ModelRegistry
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    name, _ = HEAD_ONLY_SETTING
    model_class = ModelRegistry._try_load_model_cls("KimiK3ForConditionalGeneration")
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "setting": os.environ.get(name),
        "reasoning": ReasoningParserManager.get_reasoning_parser("kimi_k3").__module__,
        "tools": ToolParserManager.get_tool_parser("kimi_k3").__module__,
        "model_class": f"{model_class.__module__}.{model_class.__qualname__}",
    }


@pytest.fixture(scope="module")
def two_node_ray():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1, resources={SECOND_NODE: 1})
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_the_plugin_registers_in_a_ray_worker_on_another_node(
    two_node_ray, tiny_k3_checkpoint, monkeypatch
):
    import cloudpickle
    from vllm.engine.arg_utils import EngineArgs
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_utils import RayWorkerWrapper

    name, value = HEAD_ONLY_SETTING
    monkeypatch.setenv(name, value)
    config = EngineArgs(
        model=str(tiny_k3_checkpoint),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        hf_overrides={"quantization_config": None},
    ).create_engine_config()
    copied = get_env_vars_to_copy(destination="RayWorkerWrapper")
    assert name in copied
    env = {var: os.environ[var] for var in copied if var in os.environ}

    worker = (
        ray.remote(RayWorkerWrapper)
        .options(num_cpus=0, resources={SECOND_NODE: 1})
        .remote(rpc_rank=0)
    )
    ray.get(worker.update_environment_variables.remote([env]))
    ray.get(
        worker.init_worker.remote(
            [
                {
                    "vllm_config": config,
                    "local_rank": 0,
                    "rank": 0,
                    "distributed_init_method": "tcp://127.0.0.1:1",
                    "is_driver_worker": True,
                }
            ]
        )
    )
    # The probe travels by value: the workers import the plugin from their own
    # environment, and nothing of the tests.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    seen = ray.get(
        worker.execute_method.remote(cloudpickle.dumps(_what_the_worker_sees))
    )
    head = ray.get_runtime_context().get_node_id()
    assert seen["node"] != head
    assert seen["setting"] == value
    assert seen["reasoning"] == "vllm_k3_plugin.parsers.reasoning_parser"
    assert seen["tools"] == "vllm_k3_plugin.parsers.tool_parser"
    assert seen["model_class"] == (
        "vllm_k3_plugin.model.model.KimiK3ForConditionalGeneration"
    )
