"""Expert parallelism: actor.expert_parallel / expert_tensor_parallel in the config and layout, and the
planner's MoE parameter counts."""

from __future__ import annotations

import math

import pytest

from launchers.planner import PlanInput, active_param_count, hf_param_count, make_plan, rank_param_counts
from megatron_arpo.config import ConfigError
from megatron_arpo.model_config import load_model_config
from megatron_arpo.models.registry import get_family
from megatron_arpo.parallel_layout import expert_world_errors, model_layout_errors
from support.configs import tiny_config

MOE = {"config": "tiny-qwen3-moe"}


def test_expert_parallel_reaches_the_layout_and_the_worker_world():
    layout = tiny_config(model=MOE, actor={"tensor_parallel": 2, "data_parallel": 2, "expert_parallel": 2}).layout
    assert (layout.tp, layout.dp, layout.ep, layout.expert_tp, layout.world_size) == (2, 2, 2, 2, 4)
    assert layout.for_world(4).ep == 2
    with pytest.raises(ValueError, match=r"actor.expert_parallel: 2 x expert tensor parallel 2 = 4 does not divide "
                                         r"data_parallel x tensor_parallel = 1 x 2 = 2; valid values with these "
                                         r"sizes: \[1\]"):
        layout.for_world(2)


@pytest.mark.parametrize(("actor", "expected"), [
    ({"expert_parallel": 3, "data_parallel": 3},
     "actor.expert_parallel: 3 does not divide tiny-qwen3-moe num_experts 4; valid values: [1, 2, 4]"),
    ({"expert_parallel": 4, "data_parallel": 2},
     "actor.expert_parallel: 4 x expert tensor parallel 1 = 4 does not divide data_parallel x tensor_parallel = "
     "2 x 1 = 2; valid values with these sizes: [1, 2]"),
    ({"expert_tensor_parallel": 3}, "actor.expert_tensor_parallel: 3 does not divide tiny-qwen3-moe "
                                    "moe_intermediate_size 128"),
    ({"tensor_parallel": 2, "data_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1},
     "actor.expert_tensor_parallel: 1 with actor.expert_parallel 2: the weight sync and the HF export stream the "
     "experts only when they are split like the dense layers (docs/moe.md); set actor.expert_tensor_parallel: null "
     "(= actor.tensor_parallel 2)"),
])
def test_bad_expert_layouts_are_refused_naming_valid_values(actor, expected):
    with pytest.raises(ConfigError) as info:
        tiny_config(model=MOE, actor=actor).layout
    assert expected in str(info.value)


def test_a_dense_model_takes_no_expert_parallelism():
    errors = model_layout_errors(load_model_config("tiny-qwen3"), 1, 1, expert_parallel=2)
    assert errors and "tiny-qwen3 is a dense model (no experts); set actor.expert_parallel: 1" in errors[0]
    assert expert_world_errors(2, 4, 4, None) == []


def test_planner_counts_published_total_and_active_parameters():
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Qwen3-235B-A22B: 235B, 22B active (the model cards).
    a3b, a22b = load_model_config("qwen3-30b-a3b"), load_model_config("qwen3-235b-a22b")
    assert round(hf_param_count(a3b) / 1e9, 1) == 30.5 and abs(active_param_count(a3b) / 1e9 - 3.3) < 0.1
    assert round(hf_param_count(a22b) / 1e9) == 235 and abs(active_param_count(a22b) / 1e9 - 22) < 0.5
    tiny = load_model_config("tiny-qwen3-moe")
    shapes = get_family(tiny.model_type).hf_tensor_shapes(tiny)
    assert hf_param_count(tiny) == sum(math.prod(s) for s in shapes.values())


def test_planner_splits_experts_over_ep_ranks():
    cfg = load_model_config("qwen3-30b-a3b")
    whole, ep8 = rank_param_counts(cfg, 1, 1), rank_param_counts(cfg, 1, 1, ep=8)
    assert whole.experts == 8 * ep8.experts
    assert whole.total - whole.experts == ep8.total - ep8.experts
    plan = make_plan(PlanInput(model=cfg, nodes=2, gpus_per_node=8, tp=1, ep=8, engine_tp=2), suggest=False)
    plain = make_plan(PlanInput(model=cfg, nodes=2, gpus_per_node=8, tp=1, engine_tp=2), suggest=False)
    assert plan.params_per_rank[0] == ep8.total and plan.actor_gib["params"] < plain.actor_gib["params"] / 4
    assert plan.active_params == active_param_count(cfg)
    with pytest.raises(ValueError, match="actor.expert_parallel: 3 does not divide"):
        make_plan(PlanInput(model=cfg, nodes=2, gpus_per_node=8, tp=1, ep=3, engine_tp=2), suggest=False)
