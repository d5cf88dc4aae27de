"""The weight sync from the actor ranks to the rollout engines: its one home.

- ``protocol``: what both halves agree on (transports, bucket layout and packing, buffer reuse, the
  verify sample, the driver's engine calls and reports);
- ``senders``: the actor side, one module per transport (gloo, NCCL, CUDA IPC), and `LocalSync`;
- ``receivers``: the engine side, vLLM weight-transfer engines for the three transports;
- ``vllm_plugin``: registers the receivers in every vLLM process.

The actor's in-rank streaming (``megatron_arpo.actor.sync_sender``) drives a sender from inside a rank.
Importing this package imports nothing; the modules import torch and vLLM themselves.
"""
