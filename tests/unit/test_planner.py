"""The planner's parameter and memory arithmetic, checked against independent per-tensor enumerations
and against the real Megatron model built on the meta device (conversion.plan); its activation formula
against the measurement lives in tests/fakecuda/test_plan_measure.py and benchmarks/planner.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

from launchers.activations import LOGITS_WORKSET, layer_activation_bytes, stage_activation_bytes
from launchers.planner import (GPU_MEMORY_GIB, GiB, PlanInput, engine_weight_bytes, format_plan, hf_param_count,
                               kv_bytes_per_token, make_plan, plan_from_config, rank_param_counts)
from megatron_arpo.model_config import load_model_config


def hf_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint, written out by HF name (independent of the planner)."""
    h, d, f, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nq * d,), p + "self_attn.k_proj.bias": (nkv * d,),
                           p + "self_attn.v_proj.bias": (nkv * d,)})
        if cfg.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


@pytest.mark.parametrize("name,expected", [("qwen3-32b", 32_762_123_264), ("qwq-32b", 32_763_876_352)])
def test_hf_parameter_count_equals_sum_of_tensor_shapes(name, expected):
    cfg = load_model_config(name)
    enumerated = sum(math.prod(s) for s in hf_tensor_shapes(cfg).values())
    assert enumerated == expected  # the published "32.8B" models, to the parameter
    assert hf_param_count(cfg) == expected


@pytest.mark.parametrize("name", ["qwen3-32b", "qwq-32b", "tiny-qwen3"])
def test_rank_shards_add_up_to_the_padded_model(name):
    cfg = load_model_config(name)
    tp, pp = (8, 4) if cfg.num_hidden_layers % 4 == 0 and cfg.num_key_value_heads % 8 == 0 else (2, 2)
    padded = cfg.padded_vocab_size(tp)
    pad_extra = (padded - cfg.vocab_size) * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    tied_copy = padded * cfg.hidden_size if cfg.tie_word_embeddings and pp > 1 else 0
    layer_norms = 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_layernorm else 0)
    replicated_norms = layer_norms * cfg.num_hidden_layers + cfg.hidden_size
    shards = sum(rank_param_counts(cfg, tp, pp, r).total for r in range(pp)) * tp
    # Each TP rank holds 1/tp of every split tensor and a full copy of every norm.
    assert shards == hf_param_count(cfg) + pad_extra + tied_copy + (tp - 1) * replicated_norms


def test_megatron_vocab_padding_for_qwen3_32b_at_tp8():
    cfg = load_model_config("qwen3-32b")
    assert cfg.padded_vocab_size(8) == 152576  # ceil(151936 / 1024) * 1024
    stage0 = rank_param_counts(cfg, 8, 4, 0)
    assert stage0.embedding == 152576 // 8 * 5120 and stage0.output_layer == 0
    last = rank_param_counts(cfg, 8, 4, 3)
    assert last.output_layer == 152576 // 8 * 5120 and last.final_norm == 5120 and last.embedding == 0
    assert stage0.layers == 16


def test_actor_bytes_per_parameter_follow_the_distributed_optimizer_table():
    cfg = load_model_config("qwen3-32b")
    for dp in (1, 4):
        p = PlanInput(model=cfg, nodes=4, gpus_per_node=8, tp=8, pp=1 if dp == 4 else 4, dp=dp,
                      recompute="full", micro_batch_tokens=1)
        plan = make_plan(p, suggest=False)
        n = plan.params_per_rank[plan.worst_stage]
        # bf16 params + fp32 grads + (fp32 main params + Adam m, v) / DP = 6 + 12/DP bytes per parameter.
        state = (plan.actor_gib["params"] + plan.actor_gib["grads"] + plan.actor_gib["optimizer"]) * GiB
        assert state == pytest.approx(n * (6 + 12 / dp), rel=1e-12)
    plain = make_plan(PlanInput(model=cfg, nodes=4, gpus_per_node=8, tp=8, pp=4, dp=1, micro_batch_tokens=1,
                                distributed_optimizer=False), suggest=False)
    assert plain.actor_gib["optimizer"] * GiB == pytest.approx(12 * plain.params_per_rank[plain.worst_stage],
                                                               rel=1e-12)


def test_layer_activations_count_the_tensors_each_layer_keeps():
    """The per-layer formula, written out tensor by tensor for QwQ-32B at TP 8 with SP (TE spec)."""
    cfg = load_model_config("qwq-32b")
    T, h, q, kv, f, d = 20480, 5120, 40 * 128, 8 * 128, 27648, 128
    kept = {  # bf16 elements per token
        "norm outputs into qkv and fc1": 2 * h / 8, "attention output projection": h / 8, "fc2 output": h / 8,
        "qkv": (q + 2 * kv) / 8, "attention output": q / 8, "fc1 (gate, up)": 2 * f / 8, "SwiGLU output": f / 8}
    expected = 2 * T * sum(kept.values()) + 8 * T * d  # + fp32 RoPE tables of q and k (THD path)
    assert layer_activation_bytes(cfg, T, 8, True) == pytest.approx(expected, rel=1e-9)
    assert layer_activation_bytes(cfg, T, 8, True, recompute="selective") == layer_activation_bytes(cfg, T, 8, True)
    assert layer_activation_bytes(cfg, T, 8, True, recompute="full") == 2 * T * h // 8  # the layer input only
    qwen3 = load_model_config("qwen3-32b")  # q/k norms keep their outputs too
    plain = dataclasses.replace(qwen3, qk_layernorm=False)
    extra = layer_activation_bytes(qwen3, T, 8, True) - layer_activation_bytes(plain, T, 8, True)
    assert extra == pytest.approx(2 * T * (64 * 128 + 8 * 128) / 8, rel=1e-9)
    # The local spec keeps more per token, and s x s attention scores without recompute.
    local = layer_activation_bytes(cfg, 4096, 8, True, layer_spec="local", seq_len=4096, recompute="selective")
    scores = layer_activation_bytes(cfg, 4096, 8, True, layer_spec="local", seq_len=4096) - local
    assert scores == 6 * 4096 * 4096 * 40 // 8
    assert local > layer_activation_bytes(cfg, 4096, 8, True)


def test_recompute_and_sequence_parallel_shrink_activations():
    cfg = load_model_config("qwq-32b")
    base = dict(model=cfg, nodes=4, gpus_per_node=8, tp=8, pp=4, micro_batch_tokens=8192)
    none = make_plan(PlanInput(**base), suggest=False).actor_gib["activations"]
    full = make_plan(PlanInput(**base, recompute="full"), suggest=False).actor_gib["activations"]
    sp = make_plan(PlanInput(**base, sequence_parallel=True), suggest=False).actor_gib["activations"]
    assert full < sp < none


def test_first_stage_holds_pipeline_depth_micro_batches_and_last_stage_the_logits():
    cfg = load_model_config("qwq-32b")
    p = PlanInput(model=cfg, nodes=4, gpus_per_node=8, tp=8, pp=4, micro_batch_tokens=8192, recompute="full",
                  sequence_parallel=True)
    first, last = stage_activation_bytes(p, 0), stage_activation_bytes(p, 3)
    assert (first["in_flight"], last["in_flight"]) == (4, 1)
    assert first["activations"] == 4 * first["kept_per_micro_batch"]
    logits = LOGITS_WORKSET * 4 * 8192 * cfg.padded_vocab_size(8) / 8
    assert last["activations"] == pytest.approx(last["kept_per_micro_batch"] + logits)
    entropy = stage_activation_bytes(dataclasses.replace(p, entropy=True), 3)
    assert entropy["activations"] > last["activations"]  # the entropy needs more fp32 copies of the logits


def test_kv_cache_and_engine_weights():
    cfg = load_model_config("qwq-32b")
    # K and V, 64 layers, 8 KV heads split over TP 4 -> 2 per GPU, head_dim 128, bf16.
    assert kv_bytes_per_token(cfg, 4) == 2 * 64 * 2 * 128 * 2
    # TP larger than the KV-head count replicates KV heads (one per GPU).
    assert kv_bytes_per_token(cfg, 16) == 2 * 64 * 1 * 128 * 2
    norms = (2 * 5120) * 64 + 5120
    assert engine_weight_bytes(cfg, 1) == 2 * hf_param_count(cfg)
    assert engine_weight_bytes(cfg, 4) == pytest.approx(2 * ((hf_param_count(cfg) - norms) / 4 + norms), abs=2)


def test_colocated_sums_actor_and_vllm_reservation_unless_sleep_and_offload():
    cfg = load_model_config("qwq-32b")
    p = PlanInput(model=cfg, nodes=4, gpus_per_node=8, tp=8, pp=2, micro_batch_tokens=20480, recompute="full",
                  sequence_parallel=True, engine_tp=4, max_model_len=10192, concurrency=64,
                  gpu_memory_utilization=0.75)
    plan = make_plan(p, suggest=False)
    reserved = 0.75 * GPU_MEMORY_GIB["h100-80g"]
    assert plan.rollout_reserved_gib == pytest.approx(reserved)
    buffer = plan.sync_gib["buffer"]  # the actor rank's IPC buffer stays between syncs
    assert buffer == pytest.approx(152064 * 5120 * 2 / GiB)
    assert plan.colocated_peak_gib == pytest.approx(plan.actor_peak_gib + reserved + buffer)
    assert plan.fits_actor and plan.fits_rollout and not plan.fits  # each alone fits, together they do not
    assert "actor peak + vLLM reservation on every GPU" in format_plan(plan)
    swapped = make_plan(dataclasses.replace(p, sleep_offload=True), suggest=False)
    assert swapped.colocated_peak_gib == pytest.approx(reserved + swapped.actor_gib["params"] + buffer)
    assert swapped.fits
    separate = make_plan(dataclasses.replace(p, placement="separate"), suggest=False)
    assert separate.fits
    # A reservation smaller than what the engine needs does not fit, whatever the placement.
    starved = make_plan(dataclasses.replace(p, gpu_memory_utilization=0.3, placement="separate"), suggest=False)
    assert not starved.fits_rollout and not starved.fits


def test_fit_decisions_and_suggestions_for_the_32b_recipes():
    cfg = load_model_config("qwq-32b")
    tight = make_plan(PlanInput(model=cfg, nodes=4, gpus_per_node=8, tp=8, pp=4, micro_batch_tokens=16384,
                                engine_tp=4, max_model_len=5632, concurrency=64, gpu_memory_utilization=0.5))
    assert not tight.fits_actor and tight.fits_rollout and not tight.fits
    assert tight.suggestions and all(s["recompute"] == "full" for s in tight.suggestions)
    for s in tight.suggestions:
        again = make_plan(PlanInput(model=cfg, nodes=4, gpus_per_node=8, tp=s["actor_tp"], pp=s["actor_pp"],
                                    recompute="full", micro_batch_tokens=16384, engine_tp=s["engine_tp"],
                                    max_model_len=5632, concurrency=64,
                                    gpu_memory_utilization=s["gpu_memory_utilization"]), suggest=False)
        assert again.fits, s
    roomy = make_plan(PlanInput(model=cfg, gpu="h200-141g", nodes=4, gpus_per_node=8, tp=8, pp=4,
                                recompute="full", engine_tp=4), suggest=False)
    assert roomy.fits and roomy.budget_gib == pytest.approx(GPU_MEMORY_GIB["h200-141g"] * 0.9 - 2.0)
    # Weight sync moves every HF parameter in bf16 to each engine.
    assert roomy.weight_sync_gib_per_engine * GiB == 2 * hf_param_count(cfg)
    assert roomy.weight_sync_gib_total == pytest.approx(roomy.weight_sync_gib_per_engine * 8)


def test_plan_from_config_reads_sections_and_rejects_bad_layouts():
    raw = {"model": {"config": "qwen3-32b"}, "actor": {"tensor_parallel": 8, "pipeline_parallel": 4,
                                                       "recompute": "full", "use_te": "false"},
           "rollout": {"tensor_parallel": 4, "max_num_seqs": 32, "response_length": 4096,
                       "gpu_memory_utilization": 0.55},
           "algorithm": {"entropy_aware_advantage": True},
           "data": {"max_prompt_tokens": 1536}, "launcher": {"nodes": 4, "gpus_per_node": 8}}
    plan = plan_from_config(raw)
    i = plan.inputs
    assert (i["tp"], i["pp"], plan.dp, i["max_model_len"], i["seq_len"]) == (8, 4, 1, 5632, 5632)
    assert (i["gpu_memory_utilization"], i["layer_spec"], i["entropy"], i["concurrency"]) == (0.55, "local", True, 32)
    assert plan.total_params == 32_762_123_264
    assert format_plan(plan).startswith("model qwen3-32b (32,762,123,264 parameters)")
    with pytest.raises(ValueError, match=r"actor.tensor_parallel: 16 does not divide qwen3-32b num_key_value_heads 8; "
                                         r"valid values: \[1, 2, 4, 8\]"):
        plan_from_config(raw, tp=16)
    with pytest.raises(ValueError, match=r"actor.pipeline_parallel: 3 does not divide qwen3-32b num_hidden_layers 64"):
        plan_from_config(raw, pp=3)
    with pytest.raises(ValueError, match=r"actor.sequence_parallel: true needs actor.tensor_parallel > 1"):
        plan_from_config({**raw, "actor": {**raw["actor"], "sequence_parallel": True}}, tp=1)
    with pytest.raises(ValueError, match="unknown gpu 'v100'"):
        plan_from_config(raw, gpu="v100")


def test_plan_cli_names_the_bad_key_and_exits_2(capsys):
    from launchers.cli import plan_main

    assert plan_main(["--model", "qwq-32b", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "actor.tensor_parallel: 3 does not divide qwq-32b num_attention_heads 40; valid values: [1, 2, 4, 8]" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", ["qwen3-32b", "qwq-32b"])
def test_per_rank_counts_equal_the_real_megatron_model_on_meta_device(name):
    plan = pytest.importorskip("conversion.plan")
    cfg = load_model_config(name)
    tp, pp = 8, 4
    for rank in range(tp * pp):
        row = plan.plan_rank(cfg, tp, pp, rank)
        assert row["problems"] == []
        assert row["num_params"] == rank_param_counts(cfg, tp, pp, row["pp_rank"]).total, (rank, row)


@pytest.mark.parametrize("recipe", ["qwq-32b-arpo-deepsearch", "qwen3-32b-arpo-reasoning"])
def test_a_colocated_32b_recipe_with_a_large_kv_cache_fits_only_with_sleep_and_offload(recipe):
    """The recipe's own layout with vLLM's reservation at 0.75 and 64 sequences per engine: the actor's peak
    and the reservation do not fit side by side, nor with one switch alone (vLLM asleep while the actor
    keeps its optimizer state, or the reverse, still holds both); with rollout.enable_sleep_mode and
    actor.offload (the config names the planner reads) a GPU holds the larger phase only."""
    import copy
    from pathlib import Path

    import yaml

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / f"{recipe}.yaml").read_text())
    assert raw["trainer"]["placement"] == "colocated"
    raw["rollout"].update(gpu_memory_utilization=0.75, max_num_seqs=64)
    plans = {}
    for sleep, offload in ((False, False), (True, False), (False, True), (True, True)):
        cfg = copy.deepcopy(raw)
        cfg["rollout"]["enable_sleep_mode"], cfg["actor"]["offload"] = sleep, offload
        plans[sleep, offload] = plan_from_config(cfg)
    reserved = 0.75 * GPU_MEMORY_GIB["h100-80g"]
    for switches in ((False, False), (True, False), (False, True)):
        plan = plans[switches]
        assert plan.fits_actor and plan.fits_rollout and not plan.fits, switches
        assert plan.colocated_peak_gib == pytest.approx(plan.actor_peak_gib + reserved + plan.sync_gib["buffer"])
    both = plans[True, True]
    assert both.fits and both.inputs["sleep_offload"]
    assert both.colocated_peak_gib == pytest.approx(max(both.actor_peak_gib, reserved + both.actor_gib["params"])
                                                    + both.sync_gib["buffer"])
    assert "phases swap (vLLM sleep + actor offload)" in format_plan(both)
    # The recipe as shipped (no switches) fits on its own, with the smaller reservation.
    assert plan_from_config(yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" /
                                            f"{recipe}.yaml").read_text())).fits


@pytest.mark.parametrize("name", ["qwq-32b", "qwen3-32b", "tiny-qwen3", "tiny-qwq", "qwen2.5-7b-instruct"])
def test_the_sync_buffer_is_the_largest_bucket_the_sender_packs(name):
    """The planner's arithmetic against the sender's own bucket plan (megatron_arpo.actor.hf_live), tied
    embeddings sending their lm_head copy in the embedding's bucket."""
    import torch

    from launchers.planner import largest_sync_bucket
    from megatron_arpo.actor.hf_live import max_bucket_bytes
    from megatron_arpo.actor.sync_sender import TIED_HEAD_ALIASES

    cfg = load_model_config(name)
    aliases = dict(TIED_HEAD_ALIASES) if cfg.tie_word_embeddings else {}
    for pp in (1, 2):
        for mib in (512, 64, 1):
            assert largest_sync_bucket(cfg, pp, mib * 2**20) == max_bucket_bytes(cfg, pp, torch.bfloat16, mib * 2**20,
                                                                                aliases), (pp, mib)


def test_the_sync_phase_counts_buffer_clone_nccl_and_fragmentation_on_their_own_lines():
    from launchers.planner import NCCL_COMMUNICATOR_GIB, sync_limit_gib

    cfg = load_model_config("qwq-32b")
    p = PlanInput(model=cfg, nodes=4, gpus_per_node=8, tp=8, pp=2, micro_batch_tokens=20480, recompute="full",
                  sequence_parallel=True, engine_tp=4, max_model_len=10192, concurrency=32,
                  gpu_memory_utilization=0.47)
    plan = make_plan(p, suggest=False)
    g = plan.sync_gib
    embedding = 152064 * 5120 * 2 / GiB  # QwQ's largest HF tensor (embedding, and the LM head): 1.45 GiB
    assert g["buffer"] == pytest.approx(embedding) and g["vllm_clone"] == pytest.approx(embedding)
    # colocated, ipc: the actor rank's TP, DP and PP groups and the sender group; the engine worker's TP group
    assert g["nccl"] == pytest.approx(5 * NCCL_COMMUNICATOR_GIB)
    # no sleep: the rollout phase's holdings, the IPC buffer on its own line
    assert g["held"] + g["buffer"] == pytest.approx(plan.colocated_peak_gib)
    rest = g["held"] + g["buffer"] + g["vllm_clone"] + g["nccl"]
    assert g["fragmentation"] == pytest.approx(0.05 * rest) and g["total"] == pytest.approx(1.05 * rest)
    assert plan.sync_peak_gib == g["total"] and plan.fits_sync and plan.fits
    assert plan.sync_peak_gib <= sync_limit_gib(p) == pytest.approx(GPU_MEMORY_GIB["h100-80g"] - 2.0)
    text = format_plan(plan)
    for line in ("weight sync (ipc, buckets of 512 MiB) on one GPU:", "  sync buffer (largest bucket): 1.45 GiB",
                 "  vLLM's clone of a bucket: 1.45 GiB", "  NCCL communicators: 1.25 GiB",
                 f"  fragmentation margin (5%): {g['fragmentation']:.1f} GiB"):
        assert line in text.splitlines(), text
    # Sleep + offload: the actor keeps its weights, vLLM has its weights back and its KV cache still asleep.
    swapped = make_plan(dataclasses.replace(p, sleep_offload=True), suggest=False)
    assert swapped.sync_gib["held"] == pytest.approx(swapped.actor_gib["params"] + swapped.rollout_gib["weights"])
    # Smaller buckets do not shrink it: the embedding is one tensor.
    assert make_plan(dataclasses.replace(p, sync_bucket_mb=64), suggest=False).sync_gib["buffer"] == g["buffer"]
    # Separate pools (nccl): the engine GPU receives a bucket and clones it, beside vLLM's reservation.
    separate = make_plan(dataclasses.replace(p, placement="separate"), suggest=False)
    assert "weight sync (nccl" in format_plan(separate)
    s = separate.sync_gib
    assert (s["held"], s["buffer"], s["vllm_clone"]) == pytest.approx((separate.rollout_reserved_gib, embedding,
                                                                        embedding))
    # engine TP + one weight-transfer group per sender (PP 2: two)
    assert s["nccl"] == pytest.approx(3 * NCCL_COMMUNICATOR_GIB)
    # A sync that does not fit makes the plan not fit, with its own verdict.
    tight = make_plan(dataclasses.replace(p, fragmentation=0.2), suggest=False)
    assert not tight.fits_sync and not tight.fits and tight.fits_actor and tight.fits_rollout
    assert "DOES NOT FIT" in [line for line in format_plan(tight).splitlines() if "sync peak" in line][0]


def test_plan_from_config_reads_the_sync_settings():
    raw = {"model": {"config": "qwq-32b"}, "actor": {"tensor_parallel": 8, "pipeline_parallel": 2},
           "rollout": {"tensor_parallel": 4, "sync_bucket_mb": 64, "sync_transport": "nccl"},
           "trainer": {"placement": "separate"}, "launcher": {"nodes": 4, "gpus_per_node": 8}}
    plan = plan_from_config(raw)
    assert (plan.inputs["sync_bucket_mb"], plan.inputs["sync_transport"]) == (64, "nccl")
