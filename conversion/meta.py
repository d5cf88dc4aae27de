"""Megatron models with no memory: meta-device GPTModels under a real or fake parallel state.

- :class:`MetaDeviceMode` forces every tensor factory onto the ``meta`` device, including the ones
  Megatron places explicitly (``device=torch.cuda.current_device()``, ``device="cpu"`` under
  ``use_cpu_initialization``), which a plain ``with torch.device("meta")`` does not catch.
- :func:`build_meta_gpt_model` builds the GPTModel of the current rank from the model config with
  ``perform_initialization=False`` (nothing to initialise on meta). It mirrors
  ``megatron_arpo.actor.model_builder.build_gpt_model`` but takes the embedding row count explicitly, so
  a TP=1 model can carry the padding a TP=T run would use.
- :func:`fake_rank` puts one process in the shoes of rank ``r`` of a ``tp * pp`` world with torch's
  fake process group (collectives are no-ops), so ``plan`` walks all 32 ranks of a TP=8/PP=4 layout in
  one process, building each rank's real Megatron modules on meta.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_arpo.actor.model_builder import build_transformer_config, get_layer_spec
from megatron_arpo.device.cpu_compat import apply_cpu_compat
from megatron_arpo.model_config import ModelConfig

logger = logging.getLogger(__name__)


class MetaDeviceMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = "meta"
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
            args = (args[0], "meta", *args[2:])
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def build_meta_gpt_model(cfg: ModelConfig, tp: int, pp: int, padded_vocab: int | None = None,
                         params_dtype: torch.dtype = torch.float32):
    """This rank's GPTModel on the meta device (parallel state must be initialised, real or fake)."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    apply_cpu_compat()
    config = build_transformer_config(cfg, tensor_parallel=tp, pipeline_parallel=pp, params_dtype=params_dtype,
                                      use_te=False)
    config.perform_initialization = False
    config.use_cpu_initialization = True
    with torch.device("meta"), MetaDeviceMode():
        return GPTModel(
            config=config,
            transformer_layer_spec=get_layer_spec(cfg, use_te=False),
            vocab_size=padded_vocab or cfg.padded_vocab_size(tp),
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(cfg.rope_theta),
        )


@contextlib.contextmanager
def fake_rank(rank: int, tp: int, pp: int) -> Iterator[None]:
    """Megatron parallel state of global rank ``rank`` in a fake ``tp * pp`` world (one process)."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state

    if dist.is_initialized():
        raise RuntimeError("fake_rank needs a process without a torch.distributed group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp * pp)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 create_gloo_process_groups=False)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
