"""The CPU compat layer: idempotent, inert when CUDA is available, pinned to one Megatron version.

The layer is process-wide once applied, so the test that applies it runs in a child interpreter and
keeps this pytest process unpatched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from megatron_arpo.device import cpu_compat

REPO_ROOT = Path(__file__).resolve().parents[2]


def _fresh_state(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_patched", False)
    monkeypatch.setattr(cpu_compat, "_thread_state", threading.local())


def test_noop_when_cuda_is_available(monkeypatch):
    _fresh_state(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    stack_depth = torch._C._len_torch_function_stack()
    assert cpu_compat.apply_cpu_compat() is False
    assert cpu_compat._patched is False
    assert torch.cuda.current_device is current_device
    assert torch._C._len_torch_function_stack() == stack_depth


def test_refuses_other_megatron_version(monkeypatch):
    import megatron.core

    _fresh_state(monkeypatch)
    monkeypatch.delenv(cpu_compat.ALLOW_ENV, raising=False)
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError) as excinfo:
        cpu_compat.apply_cpu_compat()
    message = str(excinfo.value)
    assert "0.17.0" in message and "0.16.1" in message
    assert "megatron_arpo/device/cpu_compat.py" in message and cpu_compat.ALLOW_ENV in message
    assert cpu_compat._patched is False


def test_env_override_allows_other_version(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    monkeypatch.setenv(cpu_compat.ALLOW_ENV, "1")
    cpu_compat._check_version()  # does not raise


def test_written_for_installed_version():
    import megatron.core

    assert megatron.core.__version__ == cpu_compat.WRITTEN_FOR


_CHILD = textwrap.dedent("""
    import threading
    import torch
    from megatron_arpo.device.cpu_compat import apply_cpu_compat
    from megatron.core.tensor_parallel import random as mcore_random

    assert apply_cpu_compat() is True
    assert apply_cpu_compat() is True
    assert torch._C._len_torch_function_stack() == 1, "second call stacked another mode"

    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).to("cuda:0").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64
    torch.cuda.synchronize()

    # The "CUDA" generator is the CPU one, and Megatron's setter really switches it.
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    first = torch.rand(3)
    mcore_random._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(3), first)

    # Torch function modes are per thread: a new thread gets its own by calling again.
    seen = []
    def worker():
        seen.append(apply_cpu_compat())
        seen.append(torch.zeros(1, device="cuda").device.type)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [True, "cpu"], seen
    print("CHILD-OK")
""")


def test_apply_is_idempotent_and_patches_megatron_paths():
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": pythonpath})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHILD-OK" in proc.stdout
