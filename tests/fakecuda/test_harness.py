"""The fake CUDA harness itself: what it claims about the device, the collective checker, host reads,
and its refusals. The checks run in one fresh subprocess, one harness session after another (the
harness changes process-wide torch state; the CPU compat check comes last because it applies that
layer for good): this file doubles as the child script (``python test_harness.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scenario import child_result

pytestmark = pytest.mark.slow


CHECKS = ("device", "collectives", "messages", "compat")  # compat last: it applies the CPU layer for good


@pytest.fixture(scope="module")
def child() -> dict:
    return child_result(__file__)


def test_gpu_branches_see_a_cuda_device(child):
    r = child["device"]
    assert r["is_available"] and r["device_count"] == 8 and r["current_device"] == 5
    assert r["capability"] == [9, 0] and r["bf16"] is True
    assert r["tensor_device"] == "cuda:5" and r["moved_device"] == "cuda:5"  # "cuda" means the current device
    assert r["mixed"].startswith("FakeTensorDeviceMismatchError")  # a cuda + cpu op fails, as on a GPU
    assert r["numpy_cuda"] == ("TypeError: can't convert cuda:5 device type tensor to numpy. Use Tensor.cpu() to "
                               "copy the tensor to host memory first.")
    assert r["numpy_host"] == [[0.0, 0.0]]  # a host copy of fake data reads as zeros
    assert r["numpy_known"] == [[3.0, 3.0]]  # ... unless the values are known (a factory's, and what follows)
    assert r["backward_grad_device"] == "cuda:5"
    assert r["accelerator"] == "cuda"


def test_collective_checker_names_each_cpu_tensor_sent_to_an_nccl_group(child):
    r = child["collectives"]
    here = f"{Path(__file__).resolve()}:"
    assert r["backends"] == {"world": "nccl", "tp": "nccl", "gloo": "gloo"}
    sites = [(v["collective"], v["devices"], v["call_site"]) for v in r["violations"]]
    assert [s[:2] for s in sites] == [("all_reduce", ["cpu"]), ("broadcast", ["cpu"]),
                                      ("batch_isend_irecv(isend)", ["cpu"])]
    lines = r["lines"]
    assert [s[2] for s in sites] == [f"{here}{lines['all_reduce']} in check_collectives",
                                     f"{here}{lines['broadcast']} in check_collectives",
                                     f"{here}{lines['p2p']} in check_collectives"]
    # The session's exit raises with all of them listed.
    assert r["raised"].startswith("CollectiveViolation: 3 collective(s) got non-CUDA tensors on NCCL groups")


def test_object_messages_recorded_by_one_rank_reach_another(child):
    r = child["messages"]
    assert r["received"] == {"step": 3} and r["sent_keys"] == ["4:0,4"]
    assert r["missing"] and "from rank 4" in r["missing"][0]


def test_refuses_to_share_a_process_with_the_cpu_compat_layer(child):
    r = child["compat"]
    assert "the CPU compat layer (megatron_arpo.device.cpu_compat) is active in this process" in r["error"]


def test_no_compiler_means_unavailable_with_the_reason(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", "from megatron_arpo.fake_cuda.harness import load_guard, FakeCudaUnavailable\n"
         "try:\n    load_guard()\nexcept FakeCudaUnavailable as exc:\n    print('UNAVAILABLE', exc)\n"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "CXX": "no-such-c++", "MEGATRON_ARPO_FAKE_CUDA_CACHE": str(tmp_path)})
    assert "UNAVAILABLE no C++ compiler ('no-such-c++' not on PATH)" in proc.stdout, proc.stderr[-2000:]


def test_a_build_lock_left_by_a_killed_builder_does_not_hang_the_next_load(tmp_path):
    from megatron_arpo.fake_cuda.harness import guard_cache_key

    probe = ("from megatron_arpo.fake_cuda.harness import load_guard, FakeCudaUnavailable\n"
             "try:\n    load_guard()\n    print('LOADED')\nexcept FakeCudaUnavailable as exc:\n    print('UNAVAILABLE', exc)\n")
    env = {**os.environ, "MEGATRON_ARPO_FAKE_CUDA_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env)
    if "UNAVAILABLE" in first.stdout:
        pytest.skip(f"fake CUDA harness unavailable: {first.stdout.strip()}")
    assert "LOADED" in first.stdout, first.stderr[-2000:]
    stale = tmp_path / guard_cache_key() / "lock"  # what torch's build baton leaves when its builder is killed
    stale.touch()
    second = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert "LOADED" in second.stdout, second.stderr[-2000:]
    assert not stale.exists()


# ----------------------------------------------------------------------------------------- children
def check_device(fc):
    import torch

    out = {}
    with fc.fake_cuda(16, 5):
        out.update(is_available=torch.cuda.is_available(), device_count=torch.cuda.device_count(),
                   current_device=torch.cuda.current_device(), capability=list(torch.cuda.get_device_capability()),
                   bf16=torch.cuda.is_bf16_supported(), accelerator=str(torch.accelerator.current_accelerator()))
        x = torch.ones(2, 2, device="cuda", requires_grad=True)
        out["tensor_device"] = str(x.device)
        out["moved_device"] = str(torch.zeros(3).cuda().device)
        try:
            x + torch.ones(2, 2)
        except Exception as exc:  # noqa: BLE001 (the type is the point)
            out["mixed"] = f"{type(exc).__name__}: {exc}"
        try:
            x.detach().numpy()
        except TypeError as exc:
            out["numpy_cuda"] = f"TypeError: {exc}"
        out["numpy_host"] = torch.empty(2, 2, device="cuda")[:1].cpu().numpy().tolist()
        out["numpy_known"] = (x.detach()[:1] * 3).cpu().numpy().tolist()
        (x * 2).sum().backward()
        out["backward_grad_device"] = str(x.grad.device)
    return out


def check_collectives(fc):
    import inspect

    import torch
    import torch.distributed as dist

    lines = {}
    with fc.fake_cuda(8, 0, check=False) as session:
        tp = dist.new_group([0, 1])
        gloo = dist.new_group([0, 1], backend="gloo")
        backends = {"world": str(dist.get_backend()), "tp": str(dist.get_backend(tp)),
                    "gloo": str(dist.get_backend(gloo))}
        cpu, dev = torch.ones(4), torch.ones(4, device="cuda")
        dist.all_reduce(dev, group=tp)  # fine
        dist.all_reduce(cpu, group=gloo)  # fine: gloo takes host tensors
        lines["all_reduce"] = inspect.currentframe().f_lineno + 1
        dist.all_reduce(cpu, group=tp)
        lines["broadcast"] = inspect.currentframe().f_lineno + 1
        dist.broadcast(cpu, src=0)
        lines["p2p"] = inspect.currentframe().f_lineno + 1
        dist.batch_isend_irecv([dist.P2POp(dist.isend, cpu, 1, tp), dist.P2POp(dist.irecv, dev, 1, tp)])
        violations = [dict(collective=v.collective, devices=list(v.devices), call_site=v.call_site)
                      for v in session.violations]
    try:
        session.check()
        raised = None
    except fc.CollectiveViolation as exc:
        raised = f"CollectiveViolation: {exc}"
    return {"backends": backends, "violations": violations, "lines": lines, "raised": raised}


def check_messages(fc):
    import torch.distributed as dist

    with fc.fake_cuda(8, 4) as sender:
        group = dist.new_group([0, 4])
        dist.broadcast_object_list([{"step": 3}], src=4, group=group)
    with fc.fake_cuda(8, 0, peer_messages=sender.sent_messages) as receiver:
        group = dist.new_group([0, 4])
        box = [None]
        dist.broadcast_object_list(box, src=4, group=group)
        dist.broadcast_object_list([None], src=4, group=group)  # nothing recorded for a second one
    return {"received": box[0], "sent_keys": sorted(sender.sent_messages), "missing": receiver.missing_peer_messages}


def check_compat(fc):
    from megatron_arpo.device import cpu_compat

    cpu_compat.apply_cpu_compat()
    try:
        with fc.fake_cuda(2, 0):
            pass
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


if __name__ == "__main__":
    from megatron_arpo.fake_cuda import harness as fake_cuda

    try:
        fake_cuda.load_guard()
    except fake_cuda.FakeCudaUnavailable as exc:
        print("RESULT " + json.dumps({"unavailable": str(exc)}))
        sys.exit(0)
    print("RESULT " + json.dumps({name: globals()[f"check_{name}"](fake_cuda) for name in CHECKS}))
