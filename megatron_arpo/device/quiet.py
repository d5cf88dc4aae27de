"""Warnings that are expected on a machine without a GPU, silenced for every command-line entry point."""

from __future__ import annotations

import warnings


def quiet_cpu_warnings() -> None:
    """Megatron warns at import that Transformer Engine/Apex are absent: expected on CPU, noise for users."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
