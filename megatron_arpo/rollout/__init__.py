"""Rollout: vLLM engines and rollout groups, the ARPO branched scheduler, trajectory records, weight sync.

Modules (each imports its heavy dependencies itself; importing this package imports nothing):

- ``engine``: ``VllmEngine`` (async continuous batching around ``vllm.LLM``), ``create_engine_actor`` (Ray),
  ``SegmentRequest``/``SegmentOutput``, ``EngineConfig``.
- ``scripted``: ``ScriptedEngine`` (same interface, deterministic) and ``CharCodec`` for tests/benchmarks.
- ``group``: ``RolloutGroup`` with sticky per-prompt routing.
- ``protocol``: ``TagProtocol`` (closing tags as stop strings, tool calls found on text, result splicing;
  shared with evaluation and the SFT data).
- ``scheduler``: ``RolloutScheduler``/``RolloutOptions`` — ARPO/AEPO branching without round barriers.
- ``trajectory``: records, JSONL save/load, ``records_to_batch`` replay into training tensors.
- ``weight_sync``: what the two halves of the weight sync agree on (bucket layout, verify sample, transports,
  the driver's engine calls); ``weight_sender`` (actor side: gloo / NCCL / IPC senders, `LocalSync` for
  tests and benchmarks); ``weight_receiver`` (engine side: vLLM weight-transfer engines); ``vllm_plugin``
  (registers the receivers in every vLLM process).
"""
