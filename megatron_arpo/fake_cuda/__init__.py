"""Fake CUDA: the actor's GPU code paths run on a machine with no GPU (docs/design/fake_cuda.md).

- ``harness``: fake CUDA devices, a fake process group and the collective checker;
- ``reads`` / ``gaps``: data-dependent reads of fake tensors, and the harness's documented gaps;
- ``guard.cpp``: the small C++ device guard a CPU-only torch lacks;
- ``memory_probe``: one rank of a real layout measured on fake tensors (``plan --measure``).

A simulation layer for tests and the planner, not part of an actor rank. Importing this package imports
nothing.
"""
