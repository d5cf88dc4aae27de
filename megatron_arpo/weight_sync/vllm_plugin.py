"""vLLM general plugin: registers this project's weight-transfer backends in every vLLM process.

vLLM creates a worker's weight-transfer engine from ``weight_transfer_config.backend`` through
``WeightTransferEngineFactory``; workers may be fresh processes (``mp`` executor started by spawn inside a
Ray actor, ``ray`` executor workers), so registering in the driver is not enough. vLLM runs the functions
of the ``vllm.general_plugins`` entry point group (setup.py) in each of its processes before it builds a
worker; `register_weight_transfer_engines` is that function. Registration is by module path: the receiver
module (``megatron_arpo.weight_sync.receivers``) is imported only when an engine is created.
Idempotent: vLLM may load plugins several times per process, and `VllmEngine` calls it too.
"""

from __future__ import annotations

from megatron_arpo.weight_sync.protocol import BACKENDS

RECEIVER_MODULE = "megatron_arpo.weight_sync.receivers"
# vLLM's ``worker_extension_cls``: the worker methods `VllmEngine` calls by name (collective_rpc).
WORKER_EXTENSION = f"{RECEIVER_MODULE}.SyncWorkerExtension"
ENGINE_CLASSES = {"gloo": "GlooWeightTransferEngine", "nccl": "StagedNCCLWeightTransferEngine",
                  "ipc": "VerifiedIPCWeightTransferEngine"}


def register_weight_transfer_engines() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for transport, backend in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(backend, RECEIVER_MODULE, ENGINE_CLASSES[transport])
        except ValueError as exc:  # registered before in this process
            if "already registered" not in str(exc):
                raise
