"""The policy's training state leaves the GPU between updates and comes back for the next one.

Colocated placement time-slices each GPU between the vLLM engines and the actor rank (``actor.offload``,
ordered by ``megatron_arpo.trainer.phases``). Between two updates the actor needs only its weights (the
log-prob pass and the weight sync read them); the gradient buffers and the optimizer state are dead
weight while vLLM generates. What moves, and how:

- **DDP grad buffers** (Megatron's flat fp32 ``grad_data`` per buffer; every ``param.main_grad`` and
  bucket is a view into it): released, not copied. Each optimizer step starts by zeroing them
  (``training.train_micro_batches`` calls ``zero_grad_buffer``), so after a step their content is dead.
  Megatron's ``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers`` do exactly this
  (``storage().resize_(0)``: the views stay valid objects, the memory goes; the restore reallocates and
  zeroes). The optimizer parameters' ``.grad`` (views into those buffers, or fp32 copies of bf16 grads)
  are dropped too; the next step assigns them again.
- **Optimizer state**: Adam's moments and, with bf16 weights, the fp32 main parameters (the distributed
  optimizer's ``shard_fp32_from_float16_groups``, the non-distributed optimizer's fp32 copies). Each
  storage is copied to a host buffer and its device storage resized to zero; the onload resizes it back
  and copies the bytes in. Working on storages rather than swapping ``param.data`` keeps every alias
  valid: optimizer-state dicts are keyed by the main-param objects, and the distributed optimizer's fp32
  shards of fp32 weights are *views of the model's weights*. Megatron's own ``offload_to_cpu`` swaps
  ``p.data`` for a CPU copy, which would move those views' bytes (the model's weights) and bring torch
  Adam's host ``step`` tensor back to the GPU on restore; here a storage that a model parameter or a
  DDP param buffer uses is never touched (the weights stay), and only storages on the training device
  move (a host ``step`` stays where it is).
- Host buffers are pinned when CUDA is available, and kept for the next cycle (pinning is slow); on a
  CPU-only machine the "device" is the host: the copy still happens and the original storage is still
  freed (the code path runs in every CPU test), and the host copy is dropped after the onload.

``StateOffloader.offload()`` / ``onload()`` return what moved (bytes, seconds). Nothing here imports
Megatron: the DDP chunks and the optimizer are duck-typed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

__all__ = ["StateOffloader"]


@dataclass
class _Moved:
    tensor: torch.Tensor   # any tensor on the storage (the storage object itself is re-read from it)
    nbytes: int
    host: torch.Tensor     # uint8 [nbytes] on the host


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a flat uint8 tensor on its device."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


def _inner_optimizers(optimizer: Any) -> Iterator[Any]:
    """Megatron's ChainedOptimizer holds one MegatronOptimizer per param-group kind; each wraps a torch one."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not getattr(opt, "is_stub_optimizer", False):
            yield inner


class StateOffloader:
    """Offload/onload of one rank's grad buffers and optimizer state (see the module docstring)."""

    def __init__(self, ddp_chunks: Iterable[Any], optimizer: Any, model_params: Iterable[torch.Tensor],
                 device: torch.device):
        self.ddp_chunks = list(ddp_chunks)
        self.optimizer = optimizer
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._keep = set()  # storages of the model's weights (and DDP's param buffers): never moved
        for p in model_params:
            self._keep.add(p.untyped_storage().data_ptr())
        for chunk in self.ddp_chunks:
            for buffer in self._buffers(chunk):
                if getattr(buffer, "param_data", None) is not None:
                    self._keep.add(buffer.param_data.untyped_storage().data_ptr())
        self._moved: list[_Moved] = []
        self._pool: dict[int, list[torch.Tensor]] = {}  # pinned host buffers by size, reused across cycles
        self.offloaded = False

    @staticmethod
    def _buffers(chunk: Any) -> list:
        return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))

    def _grad_bytes(self) -> int:
        return sum(b.grad_data.untyped_storage().nbytes() for c in self.ddp_chunks for b in self._buffers(c)
                   if getattr(b, "grad_data", None) is not None)

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """One tensor per distinct storage of optimizer state on the training device, weights excluded."""
        found, seen = [], set(self._keep)
        for inner in _inner_optimizers(self.optimizer):
            candidates = [p for group in inner.param_groups for p in group["params"]]
            candidates += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
            for t in candidates:
                if t.device != self.device:
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in seen or t.untyped_storage().nbytes() == 0:
                    continue
                seen.add(ptr)
                found.append(t)
        return found

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        pool = self._pool.get(nbytes)
        if pool:
            return pool.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self._pinned)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def offload(self) -> dict[str, float]:
        """Free the grad buffers, move the optimizer state to the host. Idempotent."""
        if self.offloaded:
            return {"offload_s": 0.0, "offload_optimizer_bytes": 0.0, "offload_grad_bytes": 0.0}
        start = time.perf_counter()
        grad_bytes = self._grad_bytes()
        for inner in _inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    p.grad = None  # a view into the grad buffer, or a copy the next step makes again
        for chunk in self.ddp_chunks:
            chunk.offload_grad_buffers(synchronize=False, empty_cache=False)
        moved = []
        for t in self._optimizer_tensors():
            nbytes = t.untyped_storage().nbytes()
            host = self._host_buffer(nbytes)
            host.copy_(_bytes_view(t), non_blocking=self._pinned)
            moved.append(_Moved(t, nbytes, host))
        self._synchronize()  # every copy has landed before a storage goes
        for m in moved:
            m.tensor.untyped_storage().resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._moved, self.offloaded = moved, True
        optimizer_bytes = sum(m.nbytes for m in moved)
        seconds = time.perf_counter() - start
        logger.debug("offloaded %.1f MiB of optimizer state, freed %.1f MiB of grad buffers in %.2f s",
                     optimizer_bytes / 2**20, grad_bytes / 2**20, seconds)
        return {"offload_s": seconds, "offload_optimizer_bytes": float(optimizer_bytes),
                "offload_grad_bytes": float(grad_bytes)}

    def onload(self) -> dict[str, float]:
        """Optimizer state back on the device, grad buffers reallocated (zeroed). Idempotent."""
        if not self.offloaded:
            return {"onload_s": 0.0, "onload_optimizer_bytes": 0.0}
        start = time.perf_counter()
        for chunk in self.ddp_chunks:
            chunk.restore_grad_buffers(synchronize=False)
        for m in self._moved:
            m.tensor.untyped_storage().resize_(m.nbytes)
            _bytes_view(m.tensor).copy_(m.host, non_blocking=self._pinned)
        self._synchronize()  # the host buffers may be reused (or freed) only once the copies are done
        if self._pinned:
            for m in self._moved:
                self._pool.setdefault(m.nbytes, []).append(m.host)
        optimizer_bytes = sum(m.nbytes for m in self._moved)
        self._moved, self.offloaded = [], False
        return {"onload_s": time.perf_counter() - start, "onload_optimizer_bytes": float(optimizer_bytes)}

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the grad buffers and the optimizer state hold on the device now (for tests and metrics)."""
        return {"grad_buffers": self._grad_bytes(),
                "optimizer": sum(t.untyped_storage().nbytes() for t in self._optimizer_tensors())}
