"""Expert parallelism: actor.expert_parallel / expert_tensor_parallel in the config and layout, and the
planner's MoE parameter counts and memory terms (against fake-CUDA measurements of 30B-A3B layouts)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from launchers.activations import (BF16, FP32, combine_bytes, global_buffer_bytes, layer_activation_bytes,
                                   stage_activation_bytes, step_bytes)
from launchers.planner import (PlanInput, actor_memory, active_param_count, hf_param_count, make_plan,
                               plan_input_from_config, rank_param_counts)
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


ROOT = Path(__file__).resolve().parents[2]
LINES = ("params", "grads", "optimizer", "activations", "temporaries")
# `megatron-arpo plan --config configs/qwen3-30b-a3b-arpo.yaml --measure --stages all --json` (benchmarks/RESULTS.md,
# "Qwen3-30B-A3B actor memory"): bytes per line of each stage in each phase, on fake CUDA at real shapes.
MEASURED_30B_A3B = {
    0: {"forward_backward": (4018876416, 8037752832, 22928265216, 8227667968, 265289728),
        "optimizer_step": (4018876416, 8037752832, 30176022528, 1339426304, 276824064)},
    1: {"forward_backward": (4018880512, 8037761024, 22928277504, 4892149248, 3425787904),
        "optimizer_step": (4018880512, 8037761024, 30176034816, 1339426304, 288358400)},
}


def _recipe_input() -> PlanInput:
    return plan_input_from_config(yaml.safe_load((ROOT / "configs" / "qwen3-30b-a3b-arpo.yaml").read_text()))


def test_planner_lines_of_the_30b_a3b_recipe_are_within_15_percent_of_the_measurement():
    stages, worst = actor_memory(_recipe_input(), dp=2)
    peaks = {}
    for stage, phases in MEASURED_30B_A3B.items():
        measured = {name: dict(zip(LINES, got)) for name, got in phases.items()}
        peak = max(measured, key=lambda name: sum(measured[name].values()))
        peaks[stage] = sum(measured[peak].values())
        row = stages[stage]
        assert row["phase"] == peak == "optimizer_step"  # both peak after the backward, in the optimizer step
        for line in LINES:  # the peak's lines, each on its own
            assert 0.85 <= row[line] / measured[peak][line] <= 1.15, (stage, line, row[line], measured[peak][line])
        # the forward/backward phase as the dense comparison reads it (activations + temporaries, and the total):
        # MemTracker books the recomputed layer's forward as activations, the planner's transient as temporaries
        fwd, got = row["phases"]["forward_backward"], measured["forward_backward"]
        ratio = (fwd["activations"] + fwd["temporaries"]) / (got["activations"] + got["temporaries"])
        assert 0.85 <= ratio <= 1.15, (stage, ratio)
        assert 0.85 <= fwd["total"] / sum(got.values()) <= 1.15
    assert worst["stage"] == max(peaks, key=peaks.get) == 1


# The recipe's layout without recompute, in rows of 512 tokens (data.max_prompt_tokens 256 + rollout.response_length
# 256), 8,192 tokens per micro-batch: the MoE layers' activations dominate the forward/backward, the peak of both
# stages. `megatron-arpo plan --config <the recipe with these keys> --measure --stages all --json`
# (benchmarks/RESULTS.md, "Qwen3-30B-A3B: the all-to-all dispatcher's copies"), bytes per line as above.
NO_RECOMPUTE = {"actor": {"recompute": "none", "micro_batch_tokens": 8192}, "data": {"max_prompt_tokens": 256},
                "rollout": {"response_length": 256}}
MEASURED_30B_A3B_NO_RECOMPUTE = {
    0: (4018876416, 8037752832, 22928265216, 42746014720, 0),
    1: (4018880512, 8037761024, 22928277504, 23258217472, 2491482112),
}
# What one micro-batch keeps on pp0 at the end of its forward, and one layer's saved tensors (a census of
# saved_tensors_hooks over a decoder layer, parameters left out).
MEASURED_KEPT_PER_MICRO_BATCH, MEASURED_LAYER = 20657845760, 863224836


def _no_recompute_input() -> PlanInput:
    raw = yaml.safe_load((ROOT / "configs" / "qwen3-30b-a3b-arpo.yaml").read_text())
    for section, keys in NO_RECOMPUTE.items():
        raw[section].update(keys)
    return plan_input_from_config(raw)


def test_planner_lines_without_recompute_are_within_15_percent_of_the_measurement():
    p = _no_recompute_input()
    stages, worst = actor_memory(p, dp=2)
    for stage, got in MEASURED_30B_A3B_NO_RECOMPUTE.items():
        row, measured = stages[stage], dict(zip(LINES, got))
        assert row["phase"] == "forward_backward"  # measured too: the step holds less (the probe saw no later peak)
        for line in ("params", "grads", "optimizer"):
            assert 0.85 <= row[line] / measured[line] <= 1.15, (stage, line, row[line], measured[line])
        ratio = (row["activations"] + row["temporaries"]) / (measured["activations"] + measured["temporaries"])
        assert 0.85 <= ratio <= 1.15, (stage, ratio)
        assert 0.85 <= row["total"] / sum(got) <= 1.15
    assert worst["stage"] == 0  # two micro-batches in flight


def test_a_moe_layer_keeps_one_copy_of_its_dispatched_tokens():
    p = _no_recompute_input()
    cfg, T = p.model, p.micro_batch_tokens
    rows = cfg.num_experts_per_tok * T  # top-k x T/4 tokens per rank, all-gathered over the expert TP 4
    layer = layer_activation_bytes(cfg, T, p.tp, True, layer_spec="local", seq_len=p.seq_len, etp=p.etp)
    assert 0.95 <= layer / MEASURED_LAYER <= 1.05  # two copies would be 1.27
    kept = stage_activation_bytes(p, 0)["kept_per_micro_batch"]
    assert 0.95 <= kept / MEASURED_KEPT_PER_MICRO_BATCH <= 1.05
    # the combine, where the forward peaks: expert output and its sorted copy (bf16), their fp32 cast and the
    # reduce-scatter output (fp32, a quarter): 2 x 256 + 512 + 128 MiB, as measured
    assert combine_bytes(p) == rows * cfg.hidden_size * (2 * BF16 + FP32 + FP32 / 4) == 1152 * 2**20


def test_the_optimizer_step_counts_the_larger_shards_copy_and_what_the_moe_backward_leaves():
    p = _recipe_input()
    cfg, T, s = p.model, p.micro_batch_tokens, p.tp
    counts = rank_param_counts(cfg, p.tp, p.pp, 1, ep=p.ep, etp=p.etp)
    dense, experts = (counts.total - counts.experts) / 2, counts.experts / 1  # expert-DP = 2 x 4 / (2 x 4) = 1
    step = step_bytes(p, 1, dense, experts)
    # torch's foreach Adam copies the shard it steps in fp32: the expert optimizer's, the larger
    assert step["optimizer"] == FP32 * counts.experts
    # the local spec's attention-scores buffer: 2 rows x 32/4 heads x 5632^2, bf16
    assert global_buffer_bytes(p) == BF16 * 2 * 8 * 5632 ** 2
    routing = (T / s) * (cfg.num_experts * 5 + cfg.num_experts_per_tok * 8)  # fp32 probs + bool map, int64 indices
    layer_input = BF16 * T * cfg.hidden_size / s
    assert step["activations"] == global_buffer_bytes(p) + 24 * (routing + layer_input)
    assert step["temporaries"] == (24 + 1) * layer_input  # each layer's input gradient + the received input's
    assert step_bytes(p, 0, dense, experts)["temporaries"] == 24 * layer_input
    # without full recompute the dispatcher keeps only its routing state; with TE, Adam steps in place
    selective = step_bytes(dataclasses.replace(p, recompute="selective"), 1, dense, experts)
    assert selective["temporaries"] == 0 and selective["activations"] == global_buffer_bytes(p) + 24 * routing
    assert step_bytes(dataclasses.replace(p, layer_spec="te"), 1, dense, experts)["optimizer"] == 0
    # a dense model leaves only the global buffer
    dense_model = dataclasses.replace(p, model=load_model_config("qwen3-32b"), ep=1, etp=None)
    assert step_bytes(dense_model, 1, 1e9, 0) == {"optimizer": FP32 * 1e9, "temporaries": 0.0,
                                                  "activations": global_buffer_bytes(dense_model)}
