"""What the plugin changes in vLLM, and why each hook exists.

1. ``ReasoningParserManager.register_module("kimi_k3", K3ReasoningParser)``: the name
   ``--reasoning-parser kimi_k3`` resolves in every process. The engine core builds
   its own reasoning parser from this registry for structured output (when did
   reasoning end?), so this must happen eagerly in each process, which vLLM's
   general-plugin loading gives us.

2. ``ToolParserManager.register_module("kimi_k3", K3ToolParser)``: the name
   ``--tool-call-parser kimi_k3`` resolves to ours (registered classes take
   precedence over vLLM's lazily imported in-tree one).

3. ``ParserManager._compose_parser`` wrapped (API server only, where it is called):
   vLLM has no registry for combined parsers. For the name ``kimi_k3`` it hard-codes
   its ``KimiK3Parser``, whose streaming rebuilds the whole output every step and
   never tells the reader how the output ended. When the composed class would carry
   our reasoning parser, we return a ``K3Parser`` subclass with the same reasoning
   and tool parser classes and strict level instead. Anything else passes through.
   The first such composition also installs ``serving_hooks``: where vLLM's serving
   layer decides a reply's finish reason, a tool call the end of the output cut off
   makes it what ended the output, not ``tool_calls`` / ``tool_use``, and
   ``/v1/messages`` keeps arguments that are not a JSON object as text; and
   ``request_hooks``: chat completions' ``thinking`` object switches the template's
   thinking.

4. ``ModelRegistry.register_model`` for ``KimiK3ForConditionalGeneration`` and
   ``KimiK31ForConditionalGeneration`` (the published checkpoints' architectures;
   on vLLM before 0.34, also K3.1's ``kimi_k31`` config, read by vLLM's K3 config
   class as 0.34 reads it, and K3.1's thinking efforts for a ``kimi_k31`` model
   in vLLM's K3 renderer, as 0.34 reads them: ``parsers.k31_efforts``, installed
   before the API server builds its renderer) and ``KimiK3ForCausalLM`` (text
   only): our
   model class, imported lazily by the process that builds the model; and
   ``KimiK3MTPModel``, our drafter on the checkpoint's MTP layers (its hidden states
   are our class's). vLLM logs the override. By default only on the CPU
   (``VLLM_K3_MODEL_CLASS=plugin`` forces it, ``vllm`` keeps vLLM's in-tree class
   everywhere). With them, a config hook (``model.cpu_config``) settles on the CPU
   what a plain ``vllm serve`` of a K3 checkpoint could not start with there.
   Without them, the class's own settings (``envs.MODEL_CLASS_SETTINGS``) change
   nothing: one warning at start names each that is set.

All are idempotent: vLLM loads general plugins once per process, but tests and
embedding code may call ``register()`` again.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from vllm_k3_plugin.reference.checkpoint_format import K3_WRAPPER, K31_WRAPPER

_COMPOSE_MARK = "_vllm_k3_plugin_wrapped"


def register_all() -> None:
    import vllm
    from vllm.logger import init_logger

    from vllm_k3_plugin.compat import check_vllm_version
    from vllm_k3_plugin.envs import (
        kda,
        kernels,
        metrics,
        mla,
        model_class,
        moe,
        replay_policy,
    )
    from vllm_k3_plugin.version import __version__

    logger = init_logger("vllm.k3_plugin")
    _declare_settings()
    # An unsupported vLLM or a bad VLLM_K3_* value fails here, at process start, not
    # in a request or when the model is built.
    check_vllm_version(getattr(vllm, "__version__", "unknown"), logger.warning)
    policy = replay_policy()
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    models = model_class(on_cpu=on_cpu)
    kernels()
    moe(on_cpu=on_cpu)
    mla(on_cpu=on_cpu)
    kda(on_gpu=current_platform.is_cuda_alike())
    metrics()
    _register_reasoning_parser()
    _register_tool_parser()
    _wrap_parser_composition()
    if models == "plugin":
        _register_model_classes()
    # vLLM configures the ``vllm`` logger tree only; ours must live under it.
    # Whether vLLM configured logging yet: its own record of the config it
    # applied (a private name in 0.32 to 0.34; where absent, logged at once).
    say_once_logging_is_configured(
        logger,
        "vllm-k3-plugin %s: kimi_k3 reasoning and tool parsers registered "
        "(replay policy: %s); Kimi-K3 model class: %s",
        __version__,
        policy.value,
        MODEL_MODULE if models == "plugin" else "vLLM's in-tree",
    )
    if models != "plugin":
        _warn_of_ignored_settings(logger, models)


def _declare_settings() -> None:
    """Tell vLLM of every ``VLLM_K3_*`` setting (``vllm.envs.environment_variables``):
    vLLM warns of a ``VLLM_`` variable it does not know, and refuses to start with
    one under ``--fail-on-environ-validation``; the torch.compile cache is keyed on
    the variables it knows, as it should be on the model class's settings."""
    import vllm.envs

    from vllm_k3_plugin.envs import SETTINGS

    known = getattr(vllm.envs, "environment_variables", None)
    if not isinstance(known, dict):
        return
    for name in SETTINGS:
        known.setdefault(name, functools.partial(os.environ.get, name))


def _warn_of_ignored_settings(logger: Any, models: str) -> None:
    """One warning naming the model class's settings that are set while vLLM's
    in-tree class serves: they change nothing, and nothing else would say so."""
    from vllm_k3_plugin.envs import MODEL_CLASS_ENV, MODEL_CLASS_SETTINGS

    ignored = [
        f"{env}={os.environ[env]}" for env in MODEL_CLASS_SETTINGS if env in os.environ
    ]
    if not ignored:
        return
    chosen_by = f"{MODEL_CLASS_ENV}={models}"
    if MODEL_CLASS_ENV not in os.environ:
        chosen_by += ", its default off the CPU"
    say_once_logging_is_configured(
        logger,
        "%s: these settings act only on the plugin's Kimi-K3 model class, which "
        "is off here (%s): vLLM's in-tree class serves and ignores them. Unset "
        "them, or set %s=plugin to serve with the plugin's class (not yet run on "
        "a GPU).",
        ", ".join(ignored),
        chosen_by,
        MODEL_CLASS_ENV,
        level=logging.WARNING,
    )


_DEFERRED_MARK = "_vllm_k3_plugin_deferred_lines"
# What say_once_logging_is_configured has said (or queued) in this process.
_SAID: set[tuple[str, int, tuple[Any, ...]]] = set()


def say_once_logging_is_configured(
    logger: Any, *line: Any, level: int = logging.INFO
) -> None:
    """Log ``line`` at ``level`` once in this process: now if vLLM has configured
    logging, else right after it does. The API server loads plugins while it
    parses its arguments, before it applies its logging config: an info line
    logged then is lost (no handler yet, and Python's default level is WARNING),
    a warning reaches stderr without vLLM's format (Python's last-resort
    handler). Registering again says nothing more."""
    import vllm.logger as vllm_logger

    said = (logger.name, level, line)
    if said in _SAID:
        return
    _SAID.add(said)
    if getattr(vllm_logger, "_last_configured_logging_config", True) is not None:
        logger.log(level, *line)
        return
    configure = vllm_logger.configure_logging
    pending = getattr(configure, _DEFERRED_MARK, None)
    if pending is None:
        pending = []

        @functools.wraps(configure)
        def configure_logging(*args: Any, **kwargs: Any) -> Any:
            vllm_logger.configure_logging = configure
            result = configure(*args, **kwargs)
            for deferred_logger, deferred_level, deferred_line in pending:
                deferred_logger.log(deferred_level, *deferred_line)
            return result

        setattr(configure_logging, _DEFERRED_MARK, pending)
        vllm_logger.configure_logging = configure_logging
    pending.append((logger, level, line))


MODEL_MODULE = "vllm_k3_plugin.model.model"
# Each architecture the plugin serves, and its class in MODEL_MODULE: Kimi-K3.1's
# wrapper is Kimi-K3's with ``dsa_config`` in its text config.
MODEL_CLASSES = {
    K3_WRAPPER[1]: "KimiK3ForConditionalGeneration",
    K31_WRAPPER[1]: "KimiK3ForConditionalGeneration",
    "KimiK3ForCausalLM": "KimiK3ForCausalLM",
}
# vLLM's speculative config names this architecture for a kimi_k3 checkpoint's MTP
# draft layers (``--speculative-config '{"method": "mtp"}'``).
MTP_ARCHITECTURE = "KimiK3MTPModel"
MTP_CLASS = "vllm_k3_plugin.model.mtp:KimiK3Mtp"


def _register_model_classes() -> None:
    from vllm import ModelRegistry

    from vllm_k3_plugin.model import cpu_config
    from vllm_k3_plugin.parsers import k31_efforts

    for architecture, name in MODEL_CLASSES.items():
        ModelRegistry.register_model(architecture, f"{MODEL_MODULE}:{name}")
    ModelRegistry.register_model(MTP_ARCHITECTURE, MTP_CLASS)
    _register_k31_config()
    k31_efforts.install()
    cpu_config.install(tuple(MODEL_CLASSES), like={K31_WRAPPER[1]: K3_WRAPPER[1]})


def _register_k31_config() -> None:
    """vLLM before 0.34 reads ``kimi_k3`` configs only; Kimi-K3.1's is the same
    class (its ``dsa_config`` kept as given), as 0.34 registers it."""
    from vllm.transformers_utils import config

    k31, k3 = K31_WRAPPER[0], K3_WRAPPER[0]
    if k31 not in config._CONFIG_REGISTRY and k3 in config._CONFIG_REGISTRY:
        config._CONFIG_REGISTRY[k31] = config._CONFIG_REGISTRY[k3]


def _register_reasoning_parser() -> None:
    from vllm.reasoning import ReasoningParserManager

    from vllm_k3_plugin.parsers.reasoning_parser import K3ReasoningParser

    ReasoningParserManager.register_module(
        name="kimi_k3", force=True, module=K3ReasoningParser
    )


def _register_tool_parser() -> None:
    from vllm.tool_parsers import ToolParserManager

    from vllm_k3_plugin.parsers.tool_parser import K3ToolParser

    ToolParserManager.register_module(name="kimi_k3", force=True, module=K3ToolParser)


def _wrap_parser_composition() -> None:
    from vllm.parser.parser_manager import ParserManager

    compose = ParserManager.__dict__.get("_compose_parser")
    if compose is None:
        # A vLLM without the composition step: nothing to replace safely.
        return
    original = compose.__func__
    if getattr(original, _COMPOSE_MARK, False):
        return

    @functools.wraps(original)
    def _compose_parser(cls: type, *args: Any, **kwargs: Any) -> Any:
        composed = original(cls, *args, **kwargs)
        return as_k3_parser(composed)

    setattr(_compose_parser, _COMPOSE_MARK, True)
    ParserManager._compose_parser = classmethod(_compose_parser)


def as_k3_parser(composed: type | None) -> type | None:
    """``composed`` rebuilt on ``K3Parser`` if it reads with our reasoning parser."""
    from vllm_k3_plugin.parsers.reasoning_parser import K3ReasoningParser

    if composed is None:
        return None
    reasoning_cls = getattr(composed, "reasoning_parser_cls", None)
    if not (
        isinstance(reasoning_cls, type) and issubclass(reasoning_cls, K3ReasoningParser)
    ):
        return composed

    from vllm_k3_plugin.parsers import request_hooks, serving_hooks
    from vllm_k3_plugin.parsers.parser import K3Parser

    serving_hooks.install()
    request_hooks.install()
    if issubclass(composed, K3Parser):
        return composed
    return type(
        "_K3Parser",
        (K3Parser,),
        {
            "reasoning_parser_cls": reasoning_cls,
            "tool_parser_cls": getattr(composed, "tool_parser_cls", None),
            "tool_strict_level": composed.tool_strict_level,
            "__module__": K3Parser.__module__,
        },
    )
