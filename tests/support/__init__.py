"""Test fixtures shared by the test tiers and the benchmarks (not part of the installed package).

- ``scripted``: ``ScriptedEngine``, a deterministic engine with ``VllmEngine``'s interface, and ``CharCodec``;
- ``slurm_local``: a real two-node Slurm cluster on this host;
- ``real_shaped``: bf16 sharded checkpoints with real models' published ``config.json`` field sets.

``tests/`` is on ``sys.path`` in every test process and its children (tests/conftest.py); benchmarks put it
there themselves.
"""
