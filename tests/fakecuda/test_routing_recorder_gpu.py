"""`RoutingRecorder`'s GPU branch on fake CUDA: the capture buffer and the input ids on the device.

The stand-in V1 runner of tests/unit/test_routing_recorder.py runs with its buffers on ``cuda``, in a fresh
child process under the fake CUDA harness (``python test_routing_recorder_gpu.py``). Each step's rows and
ids then leave the device through a non-blocking copy and an event, and are filed at the next step: the
rows must equal the CPU run's, the prefix-cache fill included.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scenario import child_result

pytestmark = pytest.mark.slow


def test_the_gpu_branch_files_the_same_rows_as_the_cpu_one():
    r = child_result(__file__)
    assert r["buffer_device"] == "cuda:0" and r["pending_event"] == "_FakeEvent"
    assert r["rows_a"] == r["expected_a"] and r["rows_b"] == r["expected_b"]
    assert r["filled_from_store"] == 8


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root.parent), str(root / "unit")]
    from megatron_arpo.fake_cuda.harness import FakeCudaUnavailable, fake_cuda
    from megatron_arpo.rollout.routing_recorder import decode_rows
    from test_routing_recorder import StandInRunner, expected

    try:
        with fake_cuda(1, 0, num_devices=1):
            runner = StandInRunner(device="cuda")
            prompt = list(range(10, 20))
            a, b = prompt + [50, 51, 52], prompt + [60, 61]
            runner.step([("a-1234abcd", a, 0, 10), ("b-99999999", b, 8, 2)])
            pending = type(runner.recorder.pending.done).__name__
            for k in range(2):
                runner.step([("a-1234abcd", a, 10 + k, 1), ("b-99999999", b, 10 + k, 1)])
            runner.step([("a-1234abcd", a, 12, 1)])
            got = runner.recorder.take(["a", "b"])
            out = {"buffer_device": str(runner.capturer.device_buffer.device), "pending_event": pending,
                   "rows_a": decode_rows(got["a"]).tolist(), "expected_a": expected(a).tolist(),
                   "rows_b": decode_rows(got["b"]).tolist(), "expected_b": expected(b[:12]).tolist(),
                   "filled_from_store": runner.recorder.stats["filled_from_store"]}
    except FakeCudaUnavailable as exc:
        out = {"unavailable": str(exc)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
