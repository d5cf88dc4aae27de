"""Every call `VllmEngine` makes into vLLM's engine core survives vLLM's msgpack encoder.

With vLLM's default multiprocessing (as on a GPU) the engine core runs in a subprocess: ``LLM`` ->
``LLMEngine.collective_rpc`` -> ``SyncMPClient.call_utility`` msgpack-encodes the method and its arguments,
and the encoder refuses functions and classes unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. Here vLLM's
own ``LLM``, ``LLMEngine`` and ``SyncMPClient.collective_rpc`` run against a client whose ``call_utility``
encodes exactly what the real one sends (no subprocess); the real engine core is exercised by
tests/integration/test_rollout_vllm.py. Passing a function (or class) to ``collective_rpc`` fails here.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.serial_utils import MsgpackEncoder  # noqa: E402

from megatron_arpo.rollout.engine import WORKER_EXTENSION, EngineConfig, engine_env  # noqa: E402
from megatron_arpo.rollout.worker_extension import EngineWorkerExtension  # noqa: E402
from megatron_arpo.weight_sync import protocol as ws  # noqa: E402
from megatron_arpo.weight_sync.receivers import GlooUpdateInfo, SyncWorkerExtension  # noqa: E402
from support.core_client import EncodingCoreClient, bare_engine  # noqa: E402


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    core = EncodingCoreClient()
    eng = bare_engine(core)
    yield eng, core
    eng._thread.shutdown(wait=True)


def test_a_full_weight_sync_crosses_into_the_engine_core_as_plain_data(engine):
    eng, core = engine
    init = ws.receiver_init_info("gloo", [("127.0.0.1", 29500)], rank_offset=1, world_size=2, timeout_s=60.0)
    info = dataclasses.asdict(GlooUpdateInfo(names=["model.norm.weight"], dtype_names=["float32"], shapes=[[8]],
                                             sender=0, stage=0, sync_id=1, bucket=0,
                                             expected={"model.norm.weight": {"sum": 1.0, "shape": [8]}}))

    async def sync():
        await eng.init_weight_transfer_engine(init)
        await eng.start_weight_update()
        await eng.update_weights(info)
        report = await eng.finish_weight_update()
        sums = await eng.checksum({"model.norm.weight": [8]})
        return report, sums

    report, sums = asyncio.run(sync())
    assert report["loaded"] == 2 and report["verified"] == ["model.norm.weight"] and sums == {"model.norm.weight": None}
    methods = [args[0] for name, args in core.calls if name == "collective_rpc"]
    assert methods == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                       "finish_weight_update", "arpo_sync_report", "arpo_param_checksums"]


def test_a_function_passed_to_collective_rpc_is_refused(engine):
    """The guard itself: what vLLM's encoder does with a function (the old ``worker_sync_report`` call)."""
    eng, _ = engine
    with pytest.raises(TypeError, match="is not serializable"):
        eng._llm.collective_rpc(lambda worker: None)
    with pytest.raises(TypeError, match="is not serializable"):
        eng._llm.collective_rpc("arpo_param_checksums", args=(SyncWorkerExtension,))


def test_the_worker_methods_resolve_by_name():
    """vLLM resolves ``worker_extension_cls`` by qualified name in each worker and calls its methods by name."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert resolve_obj_by_qualname(WORKER_EXTENSION) is EngineWorkerExtension
    assert issubclass(EngineWorkerExtension, SyncWorkerExtension)
    assert {"arpo_sync_report", "arpo_param_checksums"} <= set(vars(SyncWorkerExtension))
    assert {"arpo_enable_routing_capture", "arpo_take_routed_experts"} <= set(vars(EngineWorkerExtension))


def test_only_ipc_payloads_turn_insecure_serialisation_on(monkeypatch):
    """A CUDA-IPC bucket carries reduce_tensor tuples (a rebuild function, classes, a dtype): vLLM's encoder
    takes them only with the flag, which `engine_env` sets for the ipc transport and no other."""
    handle = (torch.multiprocessing.reductions.rebuild_cuda_tensor,
              (torch.Tensor, (4,), (1,), 0, torch.UntypedStorage, torch.bfloat16, 0, b"handle", 8, 0, False))
    payload = ("collective_rpc", "update_weights", None, (), {"update_info": {"ipc_handles": {"GPU-0": handle}}})
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(TypeError, match="is not serializable"):
        MsgpackEncoder().encode(payload)
    for transport in (None, "gloo", "nccl"):
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in engine_env(EngineConfig(model="m", weight_transfer=transport))
    env = engine_env(EngineConfig(model="m", weight_transfer="ipc"))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", env["VLLM_ALLOW_INSECURE_SERIALIZATION"])
    assert MsgpackEncoder().encode(payload)
