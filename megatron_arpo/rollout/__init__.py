"""Rollout: vLLM engines and rollout groups, the ARPO branched scheduler, trajectory records.

Modules (each imports its heavy dependencies itself; importing this package imports nothing):

- ``engine``: ``VllmEngine`` (async continuous batching around ``vllm.LLM``), ``SegmentRequest``/``SegmentOutput``,
  ``EngineConfig``.
- ``engine_actor``: ``create_engine_actor`` (the engine as a Ray async actor) and its options.
- ``group``: ``RolloutGroup`` with sticky per-prompt routing.
- ``protocol``: ``TagProtocol`` (closing tags as stop strings, tool calls found on text, result splicing;
  shared with evaluation and the SFT data).
- ``scheduler``: ``RolloutScheduler``/``RolloutOptions`` — ARPO/AEPO branching without round barriers.
- ``trajectory``: records, JSONL save/load, ``records_to_batch`` replay into training tensors.

The weight sync into the engines lives in ``megatron_arpo.weight_sync``.
"""
