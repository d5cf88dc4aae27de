"""megatron_arpo.device.local_ranks.run_distributed: results by rank, worker errors, timeouts."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_arpo.device.local_ranks import DistributedWorkerError, run_distributed


def _all_reduce_rank(rank: int, world_size: int, scale: float, *, offset: float = 0.0) -> dict:
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return {"rank": rank, "sum": value * scale + offset, "cuda_device": torch.zeros(1, device="cuda").device.type}


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever; the parent must kill it


def _hang(rank: int, world_size: int) -> None:
    time.sleep(600)


def test_returns_results_in_rank_order_with_compat_applied():
    results = run_distributed(_all_reduce_rank, 2, 10.0, offset=1.0, timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        torch.testing.assert_close(r["sum"], torch.tensor([11.0]))
        assert r["cuda_device"] == "cpu"  # apply_cpu_compat ran in the worker


def test_worker_exception_names_rank_and_traceback():
    with pytest.raises(DistributedWorkerError) as excinfo:
        run_distributed(_fail_on_rank_1, 2, timeout=120)
    assert excinfo.value.rank == 1
    assert "ValueError: boom on purpose" in excinfo.value.traceback_text
    assert "_fail_on_rank_1" in excinfo.value.traceback_text


def test_timeout_kills_workers():
    with pytest.raises(TimeoutError, match=r"within 10s; ranks still running: \[0, 1\]"):
        run_distributed(_hang, 2, timeout=10)


def test_rejects_unpicklable_function():
    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(lambda rank, world_size: None, 1)
