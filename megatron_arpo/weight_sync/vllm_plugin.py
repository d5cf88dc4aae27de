"""vLLM general plugin: registers this project's weight-transfer backends in every vLLM process.

vLLM creates a worker's weight-transfer engine from ``weight_transfer_config.backend`` through
``WeightTransferEngineFactory``; workers may be fresh processes (``mp`` executor started by spawn inside a
Ray actor, ``ray`` executor workers), so registering in the driver is not enough. vLLM runs the functions
of the ``vllm.general_plugins`` entry point group (setup.py) in each of its processes before it builds a
worker; `register_weight_transfer_engines` is that function. Registration is by module path: the receiver
module (``megatron_arpo.weight_sync.receivers``) is imported only when an engine is created.
Idempotent: vLLM may load plugins several times per process, and `VllmEngine` calls it too.

The plugin also installs `RotaryReloadWarningFilter` in every vLLM process (see its docstring).
"""

from __future__ import annotations

import logging
import re

from megatron_arpo.weight_sync.protocol import BACKENDS

RECEIVER_MODULE = "megatron_arpo.weight_sync.receivers"
ENGINE_CLASSES = {"gloo": "GlooWeightTransferEngine", "nccl": "StagedNCCLWeightTransferEngine",
                  "ipc": "VerifiedIPCWeightTransferEngine"}


# vLLM's layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py) logs this warning.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_ROTARY_NO_WEIGHTS = re.compile(r"^\w*RotaryEmbedding: Failed to load weights$")


class RotaryReloadWarningFilter(logging.Filter):
    """Drops vLLM's ``RotaryEmbedding: Failed to load weights``, logged once per weight sync.

    After a layerwise reload, vLLM warns for every layer that owns tensors but received none. A rotary
    embedding owns exactly one: ``cos_sin_cache``, a non-persistent buffer computed from the rope settings
    when the engine starts. No checkpoint and no sync carries it, so it never receives bytes; vLLM then
    puts the layer's own cache back (``_place_kernel_tensors``), which is what it already held. The cache
    depends on the model config only, never on the trained weights: nothing is lost. Only that message is
    dropped; the same warning for any other layer (a weight the sync really missed) still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not _ROTARY_NO_WEIGHTS.match(record.getMessage())
        except (TypeError, ValueError):  # a malformed record is not ours to judge
            return True


def install_vllm_log_filters() -> None:
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, RotaryReloadWarningFilter) for f in reload_logger.filters):
        reload_logger.addFilter(RotaryReloadWarningFilter())


def register_weight_transfer_engines() -> None:
    install_vllm_log_filters()
    # deferred: pulls in vllm (heavy; this module imports without it)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for transport, backend in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(backend, RECEIVER_MODULE, ENGINE_CLASSES[transport])
        except ValueError as exc:  # registered before in this process
            if "already registered" not in str(exc):
                raise
