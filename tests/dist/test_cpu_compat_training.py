"""Real Megatron-Core training on 2 gloo CPU processes through the CPU compat layer.

Each case builds a tiny GPTModel with ``build_gpt_model`` from a model YAML, wraps it in Megatron DDP,
takes the Megatron optimizer (Adam, grad clipping at 1.0) and runs a few steps of Megatron's
``get_forward_backward_func`` schedule on a fixed random batch, which the model must start to memorise:

- TP=2 on tiny-qwen3 (q/k layernorm, tied embeddings) and tiny-qwq (QKV bias): both TP ranks see the
  same loss and the same global grad norm;
- PP=2 on tiny-qwen3 (tied embeddings split across stages) with 1F1B over 4 micro-batches;
- DP=2 on tiny-qwq (QKV bias, untied) with the distributed optimizer: ranks train on different data but
  end with identical parameters.
"""

from __future__ import annotations

import pytest
import torch

from megatron_arpo.device.local_ranks import run_distributed

SEQ_LEN = 32
MICRO_BATCH = 2
STEPS = 6


def _train(rank: int, world_size: int, model_name: str, tp: int, pp: int, num_micro_batches: int,
           use_distributed_optimizer: bool) -> dict:
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_arpo.actor import model_builder
    from megatron_arpo.model_config import load_model_config

    model_cfg = load_model_config(model_name)
    model_builder.initialize_model_parallel(tp, pp, seed=1234)
    model = model_builder.build_gpt_model(model_cfg, tensor_parallel=tp, pipeline_parallel=pp)
    config = model.config
    ddp_model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer),
        module=model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, weight_decay=0.0,
                        use_distributed_optimizer=use_distributed_optimizer),
        [ddp_model],
    )

    # Same batch on every TP/PP rank of a data-parallel replica, different across replicas.
    gen = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, model_cfg.vocab_size, (num_micro_batches, MICRO_BATCH, SEQ_LEN + 1),
                           generator=gen)
    mask = model_builder.causal_attention_mask(SEQ_LEN)
    position_ids = torch.arange(SEQ_LEN)[None].expand(MICRO_BATCH, -1)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()  # output_tensor: per-token loss [b, s]
        # clone: the schedule divides the returned loss by num_micro_batches in place
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch[:, :-1], position_ids, mask, labels=batch[:, 1:])
        return out, loss_func

    forward_backward = get_forward_backward_func()
    losses, grad_norms = [], []
    for _ in range(STEPS):
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step, data_iterator=iter(tokens), model=[ddp_model],
            num_microbatches=num_micro_batches, seq_length=SEQ_LEN, micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok, "optimizer step was skipped"
        grad_norms.append(float(grad_norm))
        if reduced:  # only the last pipeline stage sees losses
            losses.append(float(torch.stack([r["loss"] for r in reduced]).mean()))
    checksum = sum(float(p.detach().double().sum()) for p in ddp_model.module.parameters())
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "checksum": checksum,
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "step_param_names": sorted(n for n, _ in model.named_parameters()),
    }


def _assert_learns(losses: list[float]) -> None:
    assert len(losses) == STEPS
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.9 * losses[0], f"loss did not fall on the fixed batch: {losses}"


@pytest.mark.parametrize("model_name", ["tiny-qwen3", "tiny-qwq"])
def test_tensor_parallel_2_trains_and_ranks_agree(model_name):
    results = run_distributed(_train, 2, model_name, 2, 1, 2, False, timeout=240)
    _assert_learns(results[0]["losses"])
    torch.testing.assert_close(results[0]["losses"], results[1]["losses"], rtol=1e-5, atol=1e-5)
    # Grad clipping computes one global norm across the TP shards.
    assert results[0]["grad_norms"] == pytest.approx(results[1]["grad_norms"], rel=1e-5)
    names = results[0]["step_param_names"]
    if model_name == "tiny-qwen3":  # tied embeddings, q/k norm
        assert "output_layer.weight" not in names
        assert "decoder.layers.0.self_attention.q_layernorm.weight" in names
    else:  # untied, sharded QKV bias
        assert {"output_layer.weight", "decoder.layers.0.self_attention.linear_qkv.bias"} <= set(names)


def test_pipeline_parallel_2_trains_through_schedule():
    results = run_distributed(_train, 2, "tiny-qwen3", 1, 2, 4, False, timeout=240)
    first, last = results
    assert not first["last_stage"] and last["last_stage"]
    assert first["losses"] == []
    _assert_learns(last["losses"])
    # Each stage holds one of the two layers; the last stage keeps a synced copy of the tied embedding.
    assert "embedding.word_embeddings.weight" in first["step_param_names"]
    assert "output_layer.weight" in last["step_param_names"]
    assert "decoder.final_layernorm.weight" in last["step_param_names"]
    assert "decoder.final_layernorm.weight" not in first["step_param_names"]
    # Grad norm is global over both stages.
    assert first["grad_norms"] == pytest.approx(last["grad_norms"], rel=1e-5)


def test_data_parallel_2_distributed_optimizer_with_clipping():
    results = run_distributed(_train, 2, "tiny-qwq", 1, 1, 2, True, timeout=240)
    for result in results:
        _assert_learns(result["losses"])
    # Different data per replica, one set of parameters after the sharded update + all-gather.
    assert results[0]["losses"][0] != results[1]["losses"][0]
    assert results[0]["checksum"] == results[1]["checksum"]
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in results[0]["step_param_names"]
    # clip_grad=1.0 with a freshly initialised model: the first-step norm is well above 1.
    assert results[0]["grad_norms"][0] > 1.0


def _parameter_shapes(rank: int, world_size: int, model_name: str) -> dict:
    from megatron_arpo.actor import model_builder
    from megatron_arpo.model_config import load_model_config

    model_builder.initialize_model_parallel(1, 1, seed=0)
    model = model_builder.build_gpt_model(load_model_config(model_name))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _expected_local_spec_shapes(qwen3: bool) -> dict:
    # tiny configs: hidden 256, 4 heads, 2 kv heads, head_dim 64, ffn 512, vocab 1000 -> padded 1024.
    expected = {"embedding.word_embeddings.weight": (1024, 256), "decoder.final_layernorm.weight": (256,)}
    for layer in range(2):
        prefix = f"decoder.layers.{layer}."
        expected.update({
            prefix + "input_layernorm.weight": (256,),
            prefix + "self_attention.linear_qkv.weight": ((4 + 2 * 2) * 64, 256),
            prefix + "self_attention.linear_proj.weight": (256, 4 * 64),
            prefix + "pre_mlp_layernorm.weight": (256,),
            prefix + "mlp.linear_fc1.weight": (2 * 512, 256),
            prefix + "mlp.linear_fc2.weight": (256, 512),
        })
        if qwen3:
            expected[prefix + "self_attention.q_layernorm.weight"] = (64,)
            expected[prefix + "self_attention.k_layernorm.weight"] = (64,)
        else:
            expected[prefix + "self_attention.linear_qkv.bias"] = ((4 + 2 * 2) * 64,)
    if not qwen3:
        expected["output_layer.weight"] = (1024, 256)
    return expected


@pytest.mark.parametrize("model_name", ["tiny-qwen3", "tiny-qwq"])
def test_local_spec_parameter_names(model_name):
    """The names documented in model_builder's docstring, which the conversion tables rely on."""
    (shapes,) = run_distributed(_parameter_shapes, 1, model_name, timeout=120)
    assert shapes == _expected_local_spec_shapes(qwen3=model_name == "tiny-qwen3")
