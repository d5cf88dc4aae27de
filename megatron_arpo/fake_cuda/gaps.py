"""Harness gaps of the fake CUDA harness (``megatron_arpo.fake_cuda.harness``): what a one-process fake world
cannot provide, patched only inside a session (listed in the harness docstring). None of this is a bug of
the code under test.
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.utils as torch_utils
from torch._subclasses.fake_tensor import unset_fake_temporarily

from megatron_arpo.fake_cuda.reads import _is_fake


class _HostSlice:
    def __init__(self, inner):
        self._inner = inner

    def __getitem__(self, index):
        with unset_fake_temporarily():
            return self._inner[index]

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _HostSafeOpen:
    """A safetensors handle whose reads are real host tensors (file contents are data, not fakes; so are
    ``torch.load`` results)."""

    def __init__(self, inner):
        self._inner = inner

    def get_slice(self, name):
        return _HostSlice(self._inner.get_slice(name))

    def get_tensor(self, name):
        with unset_fake_temporarily():
            return self._inner.get_tensor(name)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def install_module_moves(patches) -> None:
    """``Module.cuda()`` / ``.bfloat16()`` on fake parameters.

    torch swaps fake parameters in place (``torch.utils.swap_tensors``) instead of assigning ``.data``, and
    refuses when the tensor has weak references; fake mode's own meta converter keeps one on every fake it
    has described. Those are fake-mode bookkeeping, not references a GPU run would have, so for two fakes
    the weak-reference check is skipped.
    """
    original = torch_utils.swap_tensors
    no_weakrefs = SimpleNamespace(getweakrefs=lambda obj: [])

    def swap_tensors(t1, t2):
        if not (_is_fake(t1) and _is_fake(t2)):
            return original(t1, t2)
        real = torch_utils.weakref
        torch_utils.weakref = no_weakrefs
        kept = dict(vars(t1))  # Megatron's parameter attributes (allreduce, tensor_model_parallel, ...)
        try:
            return original(t1, t2)
        finally:
            torch_utils.weakref = real
            # A swap also swaps __dict__: the module's parameter would lose what Megatron set on it (a GPU's
            # `param.data = ...` keeps it), e.g. `allreduce=False` that puts experts in their own grad buffer
            # and optimizer. Keep them on the parameter the module holds.
            for key, value in kept.items():
                vars(t1).setdefault(key, value)

    patches.set(torch_utils, "swap_tensors", swap_tensors)


def install_host_io(patches) -> None:
    # deferred: pulls in safetensors (heavy; this module imports without it)
    import safetensors

    original = safetensors.safe_open
    patches.set(safetensors, "safe_open", lambda *a, **k: _HostSafeOpen(original(*a, **k)))
    original_load = torch.load

    def load(*args, **kwargs):
        with unset_fake_temporarily():
            return original_load(*args, **kwargs)

    patches.set(torch, "load", load)


def _host_zeros(t: torch.Tensor) -> torch.Tensor:
    if not _is_fake(t):
        return t

    with unset_fake_temporarily():
        return torch.zeros(t.shape, dtype=t.dtype)


class _DistAsRankZero:
    def get_rank(self, group=None):
        return 0 if group is None else dist.get_rank(group)

    def __getattr__(self, name):
        return getattr(dist, name)


class _TorchAsRankZero:
    """``torch`` for a module whose global-rank-0 duties this process must also do."""

    distributed = _DistAsRankZero()

    def __getattr__(self, name):
        return getattr(torch, name)


def install_megatron_gaps(patches) -> None:
    """The harness gaps listed in the module docstring (only what a one-rank fake world cannot provide)."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import p2p_communication

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [torch.linalg.vector_norm(t.float()) for t in tensor_lists[0]]
        return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None

    patches.set(clip_grads, "l2_norm_impl", l2_norm)

    comm_cls = p2p_communication.P2PCommunicator
    original_comm = comm_cls._communicate
    original_shapes = comm_cls._communicate_shapes
    state = threading.local()

    def _communicate(self, *args, **kwargs):
        state.tensor_shape = kwargs.get("tensor_shape")
        return original_comm(self, *args, **kwargs)

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        original_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)  # its tensors are checked
        shape = list(state.tensor_shape) if getattr(state, "tensor_shape", None) is not None else None
        return (shape if recv_prev else None), (shape if recv_next else None)

    patches.set(comm_cls, "_communicate", _communicate)
    patches.set(comm_cls, "_communicate_shapes", _communicate_shapes)

    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.dist_checkpointing import serialization, validation
    from megatron.core.dist_checkpointing.strategies import common as ckpt_common

    from megatron.core.dist_checkpointing import state_dict_utils

    for module in (validation, state_dict_utils):
        patches.set(module, "validate_sharding_integrity", lambda *a, **k: None)
    patches.set(validation, "_validate_common_state_dict", lambda *a, **k: None)
    # In a world of one this rank is the main replica of everything it holds: it saves all it will load.
    from megatron.core.dist_checkpointing.strategies import torch as ckpt_torch

    for module in (ckpt_torch, ckpt_common):
        patches.set(module, "is_main_replica", lambda replica_id: True)
    # Megatron's rank 0 writes a dist checkpoint's metadata.json and common.pt; no other process will here.
    for module in (serialization, ckpt_common):
        patches.set(module, "torch", _TorchAsRankZero())
    # deferred: pulls in torch.distributed.checkpoint (heavy; this module imports without it)
    from torch.distributed.checkpoint import utils as dcp_utils

    original_wrapper_init = dcp_utils._DistWrapper.__init__

    def one_rank_wrapper(self, group, use_dist, coordinator_rank):
        original_wrapper_init(self, group, False, 0)

    patches.set(dcp_utils._DistWrapper, "__init__", one_rank_wrapper)

    # The bytes a checkpoint writes for a fake tensor are zeros (a host copy of device data is a data read).
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original_preload = FileSystemWriterAsync.preload_tensors

    def preload_tensors(write_buckets, non_blocking=True):
        result = []
        for file_name, storage_key, (bytes_data, tensor_data) in original_preload(write_buckets, non_blocking):
            result.append((file_name, storage_key, (bytes_data, [(item, _host_zeros(t)) for item, t in tensor_data])))
        return result

    patches.set(FileSystemWriterAsync, "preload_tensors", staticmethod(preload_tensors))


def reset_megatron_globals() -> None:
    """Megatron's process-wide state that holds one session's devices or streams, dropped at the session's end
    (a later session in the process is another rank, on another device): the MoE auxiliary-loss tracker
    (per-layer loss tensors), the auxiliary-loss gradient scale and the all-to-all dispatcher's shared
    device-to-host stream."""
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    dispatcher = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    if dispatcher is not None:
        dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
