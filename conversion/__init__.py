"""HF <-> Megatron checkpoint conversion for Qwen3 and QwQ-32B (qwen2): tables, streaming I/O, verify.

Light on purpose: importing ``conversion`` imports nothing heavy (no torch, no Megatron). Modules:
``mapping`` (tables, sharding), ``hf_io`` (lazy safetensors, shard writer), ``outdir`` (output path
guards, ``--overwrite`` marker, stale temp cleanup, atomic dirs), ``config_json`` (config.json carried
over), ``live`` (load HF weights into / export from a live Megatron model), ``dist_ckpt`` + ``dcp_write`` +
``torch_record`` (HF -> Megatron distributed checkpoint from the tables, without importing Megatron),
``dcp_read`` + ``megatron_to_hf`` (Megatron -> HF without importing Megatron), ``plan`` (meta-device dry run), ``verify`` and the ``python -m conversion`` CLI in
``__main__``.
"""
