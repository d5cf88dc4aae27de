"""The offline HF <-> Megatron converter, above the actor: ``python -m conversion`` and what it runs.

Light on purpose: importing ``conversion`` imports nothing heavy (no torch, no Megatron). Modules:
``dist_ckpt`` + ``dcp_write`` + ``torch_pickle`` + ``torch_record`` (HF -> Megatron distributed
checkpoint from the tables, without importing Megatron), ``dcp_read`` + ``megatron_to_hf`` (Megatron ->
HF without importing Megatron), ``meta`` + ``plan`` (meta-device dry run), ``parity`` and ``verify``, and
the CLI in ``__main__``. They stand on ``megatron_arpo.hf`` (tables, safetensors I/O, output
directories) and ``megatron_arpo.ckpt_format`` (the ``torch_dist`` format the actor reads as well).
"""
