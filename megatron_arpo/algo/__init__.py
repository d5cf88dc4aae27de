"""Pure ARPO/AEPO algorithm functions: torch + stdlib only, no Megatron, no process groups.

- ``advantages``: GRPO group-normalised advantages (``grpo_advantages``).
- ``losses``: PPO/dual-clip policy loss with AEPO's gradient-preserving upper clip (``policy_loss``),
  AEPO entropy-aware advantages, KL estimators, full-vocabulary token entropy.
- ``entropy``: segment entropy from engine top-k log-probs (``segment_entropy``).
- ``off_policy``: decoupled PPO's truncated behaviour importance weights (``trainer.mode: off_policy``).
- ``branching``: ARPO/AEPO branch rules, AEPO initial rollouts, the recorded ``BranchRng`` stream.

Submodules import torch themselves; importing this package imports nothing.
"""
