"""CPU compat layer: lets the real Megatron-Core 0.16.1 train on a CUDA-less machine with gloo.

Megatron-Core assumes a GPU in a handful of places on the GPTModel / DDP / distributed-optimizer /
pipeline-schedule path. ``apply_cpu_compat()`` patches exactly those, and only when
``torch.cuda.is_available()`` is False; on a GPU machine it does nothing. It is pinned to the Megatron
version it was read against: a different version must be re-checked (update ``WRITTEN_FOR`` in this
file) or explicitly allowed with ``MEGATRON_ARPO_ALLOW_UNPINNED_COMPAT=1``.

The patches, and the Megatron code path that needs each:

1. A global ``TorchFunctionMode`` (:class:`_CudaToCpuMode`) that
   - rewrites ``device=`` arguments naming CUDA (``"cuda"``, ``torch.device("cuda", i)``, or the bare
     int ``torch.cuda.current_device()`` returns) to CPU, and ``Tensor.to("cuda")`` likewise. Megatron
     allocates on ``torch.cuda.current_device()`` in the TP linear/embedding layers
     (``tensor_parallel/layers.py``), the DDP grad buffers (``distributed/param_and_grad_buffer.py``),
     the pipeline send/recv buffers and shape exchange (``pipeline_parallel/p2p_communication.py``), the
     RoPE table (``rotary_pos_embedding.py``), and on ``device="cuda"`` for the token counts in
     ``pipeline_parallel/schedules.py`` and the norm accumulators in ``optimizer/clip_grads.py``;
   - makes ``Tensor.cuda()`` return the tensor: ``language_module.py`` moves the tied output weight of
     the last pipeline stage with it, ``tensor_parallel.broadcast_data`` the batch, and the optimizer's
     state-dict loading the restored state;
   - answers ``Tensor.type()`` (no argument) with the ``torch.cuda.*Tensor`` name: the optimizers
     (``optimizer.py`` ``Float16OptimizerWithFloat16Params``, ``distrib_optimizer.py``
     ``_build_model_and_main_param_groups``) and ``clip_grads.py`` accept only
     ``'torch.cuda.FloatTensor'`` / ``'torch.cuda.BFloat16Tensor'`` / ``'torch.cuda.HalfTensor'``.
     This is process-wide: any ``.type()`` call in a process that applied the layer says ``cuda``.
2. ``torch.cuda.{current_device,synchronize,get_rng_state,set_rng_state,manual_seed}`` stubs (the
   originals raise "Torch not compiled with CUDA"). ``current_device`` feeds the allocations above;
   ``synchronize`` is called by ``p2p_communication.py`` and DDP buffer (de)allocation. The RNG ones map
   the "CUDA" generator onto the CPU generator: ``model_parallel_cuda_manual_seed`` and
   ``CudaRNGStatesTracker.add`` (``tensor_parallel/random.py``) seed and snapshot it.
3. ``tensor_parallel.random._{get,set}_cuda_rng_state``: they use ``torch.cuda.default_generators`` and
   ``torch.cuda._lazy_call``, which without CUDA queues the call forever, so ``tracker.fork()`` (around
   TP weight init and attention dropout) would silently not switch streams. Replaced by the CPU
   generator, so the fork really draws from the per-TP-rank stream.
4. ``tensor_parallel.mappings``' gather / reduce-scatter helpers run under the mode of (1) whatever
   thread calls them: the backward of the MoE all-gather token dispatcher (expert parallelism) calls them
   from the autograd engine, where the thread's mode is not in force, and they allocate on
   ``torch.cuda.current_device()``.
5. A logging filter on ``megatron.core.tensor_parallel.random`` dropping "CPU RNG state changed within
   GPU RNG context": with (3) the fork changes the CPU generator by design, and it would warn on every
   fork.

Models must be given an explicit attention mask (``model_builder.causal_attention_mask``): the default
causal mask path is only taken by fused/TE kernels that do not exist on CPU.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

WRITTEN_FOR = "0.16.1"
ALLOW_ENV = "MEGATRON_ARPO_ALLOW_UNPINNED_COMPAT"

_patched = False
_thread_state = threading.local()  # torch function modes are per thread


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal (what torch.cuda.current_device() hands to device=).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _check_version() -> None:
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version != WRITTEN_FOR and os.environ.get(ALLOW_ENV) != "1":
        raise RuntimeError(
            f"megatron_arpo/device/cpu_compat.py was written for megatron-core {WRITTEN_FOR}, but "
            f"megatron-core {version} is installed. Re-check the CUDA assumptions listed in "
            f"megatron_arpo/device/cpu_compat.py against {version} and update WRITTEN_FOR there, or set "
            f"{ALLOW_ENV}=1 to try it anyway."
        )


def _cpu_get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


class _DropForkRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, and must keep doing so harmlessly.
    torch.default_generator.manual_seed(int(seed))


_MAPPING_HELPERS = ("_gather_along_first_dim", "_reduce_scatter_along_first_dim", "_gather_along_last_dim",
                    "_reduce_scatter_along_last_dim")


def _under_cpu_mode(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _CudaToCpuMode():
            return fn(*args, **kwargs)
    return wrapped


def apply_cpu_compat() -> bool:
    """Install the CPU patches (once per process, and the mode once per calling thread).

    Returns True when the layer is active, False on a CUDA machine (nothing is touched). The
    ``TorchFunctionMode`` is thread-local in torch: a thread that runs Megatron code other than the
    one that first called this (e.g. a threaded or async Ray actor) must call it too.
    """
    global _patched
    if torch.cuda.is_available():
        return False
    if not _patched:
        _check_version()
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core.tensor_parallel import mappings, random as mcore_random

        for name in _MAPPING_HELPERS:
            setattr(mappings, name, _under_cpu_mode(getattr(mappings, name)))
        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.get_rng_state = _cpu_get_rng_state
        torch.cuda.set_rng_state = _cpu_set_rng_state
        torch.cuda.manual_seed = _cpu_manual_seed
        mcore_random._get_cuda_rng_state = _cpu_get_rng_state
        mcore_random._set_cuda_rng_state = _cpu_set_rng_state
        logging.getLogger(mcore_random.__name__).addFilter(_DropForkRngWarning())
        _patched = True
        logger.info("CPU compat layer for megatron-core %s active", WRITTEN_FOR)
    if getattr(_thread_state, "mode", None) is None:
        _thread_state.mode = _CudaToCpuMode()
        _thread_state.mode.__enter__()  # stays on this thread's mode stack for the thread's life
    return True
