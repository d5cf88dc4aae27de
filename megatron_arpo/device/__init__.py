"""How Megatron runs on this machine's devices, apart from the actor's own code.

- ``cpu_compat``: the small compat layer that lets Megatron-Core run on a CPU (active only without CUDA);
- ``local_ranks``: ``run_distributed``, a function run on N local gloo ranks (tests, ``verify``).

Importing this package imports nothing.
"""
