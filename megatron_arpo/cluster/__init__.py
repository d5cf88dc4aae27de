"""Ray and Slurm plumbing; submodules import their heavy dependencies themselves.

- ``bootstrap``: one node's part of a Ray cluster inside a Slurm allocation (readiness handshake).
- ``ports``: per-job Ray port blocks, derived from the job id and checked free.
- ``allocation``: the CPUs an allocation really gives a node; Ray's session logs copied to the run dir.
- ``runtime``: ``connect_ray`` (join, form inside an allocation, or start a private local instance).
- ``placement`` / ``worker_group``: resource pools and one Ray actor per rank.
"""
