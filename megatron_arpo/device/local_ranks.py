"""Run a function on N local gloo ranks: `python -m conversion verify` and the multi-process CPU tests use it.

``run_distributed(fn, world_size, *args, **kwargs)`` starts ``world_size`` fresh processes, gives each an
initialised gloo process group and the CPU compat layer (``megatron_arpo.device.cpu_compat.apply_cpu_compat``),
calls ``fn(rank, world_size, *args, **kwargs)`` and returns the per-rank return values in rank order.

- Workers are forked from a forkserver: a fresh interpreter that has imported torch, megatron-core and
  transformers once (``PRELOAD``) and does nothing else, so no CUDA context, OpenMP pool or compat patch
  is inherited, and no worker pays those imports again. The server keeps the environment it started
  with, so each worker takes the caller's ``os.environ`` as it is at the call.
- ``fn`` must be a module-level (picklable) function; its return value must be picklable. Results travel
  as ``torch.save`` bytes, so tensors come back as ordinary tensors, not shared-memory handles that die
  with the worker.
- A worker exception is raised in the parent as :class:`DistributedWorkerError` carrying the rank and
  the worker's traceback text; the other workers are killed (they would otherwise wait forever in the
  next collective).
- ``timeout`` (seconds) bounds the whole run; on expiry every worker is killed and ``TimeoutError`` is
  raised.
- Each worker runs with one intra-op thread (``OMP_NUM_THREADS=1``): CI boxes have two cores and two
  ranks.
- Megatron's parallel state (if the function initialised it) and the process group are destroyed before
  a worker exits.

This module does not import megatron; workers import it through ``apply_cpu_compat``.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Imported once by the forkserver (a module that is missing is skipped by multiprocessing).
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.dist_checkpointing", "megatron_arpo.device.cpu_compat", "transformers")


class DistributedWorkerError(RuntimeError):
    """A rank of :func:`run_distributed` raised; ``traceback_text`` is the worker's formatted traceback."""

    def __init__(self, rank: int, traceback_text: str):
        self.rank = rank
        self.traceback_text = traceback_text
        super().__init__(f"rank {rank} failed:\n{traceback_text}")


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serialize(value: Any) -> bytes:
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _deserialize(payload: bytes) -> Any:
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def _cleanup_worker() -> None:
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch.distributed as dist

    if "megatron.core.parallel_state" in sys.modules:
        try:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        except Exception:  # cleanup must not mask the real result
            logger.warning("destroy_model_parallel failed", exc_info=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, port: int, timeout: float, fn: Callable, args: tuple,
            kwargs: dict, results: Any, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment, not the one the forkserver started with
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        from megatron_arpo.device.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", _serialize(value)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit in fn
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            _cleanup_worker()
        except Exception:
            logger.warning("rank %d: process group cleanup failed", rank, exc_info=True)


def _kill_all(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300, **kwargs: Any) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if getattr(fn, "__name__", "<lambda>") == "<lambda>" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(f"run_distributed needs a module-level function (picklable), got {fn!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when this process first starts the server
    results = ctx.Queue()
    port = find_free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, timeout, fn, args, kwargs, results, environ),
                    name=f"run_distributed-rank{rank}")
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(
                    f"run_distributed({fn.__qualname__}, world_size={world_size}) did not finish within "
                    f"{timeout}s; ranks still running: {missing}. Raise timeout= or look for a rank stuck "
                    f"in a collective the others never reached."
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in outputs and p.exitcode is not None and p.exitcode != 0]
                if dead:
                    # Died without reporting (segfault, OOM kill): drain a late report first.
                    time.sleep(0.5)
                    if results.empty():
                        raise DistributedWorkerError(
                            dead[0], f"worker exited with code {procs[dead[0]].exitcode} without a result")
                continue
            if status == "error":
                raise DistributedWorkerError(rank, payload)
            outputs[rank] = _deserialize(payload)
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 5))
    finally:
        _kill_all(procs)
        results.close()
    return [outputs[rank] for rank in range(world_size)]
