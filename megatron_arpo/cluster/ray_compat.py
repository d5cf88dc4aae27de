"""Which Ray versions the trainer runs on, and the one Ray setting its vLLM engine actors need.

An engine actor with ``num_gpus=0`` (rollout TP > 1 on GPU: vLLM's ray workers hold the GPUs) must still
see the node's GPUs, or it takes the CPU path. Ray decides that: when a worker runs a task with no GPU
assigned, it sets ``CUDA_VISIBLE_DEVICES=""`` if ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`` is true.

- Ray < 2.50 always blanks it (the variable does not exist yet): refused.
- Ray 2.50 - 2.55 blanks it by default; ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0`` keeps it.
- Ray >= 2.56 keeps it by default (``=1`` brings the blanking back, e.g. from a cluster-wide setting).

So ``ENGINE_RAY_ENV`` sets the variable to ``0`` on every engine actor (``rollout.engine``), whatever the
version or the cluster's environment, and ``check_ray_version`` refuses anything older than the floor
that ``setup.py`` declares. docs/placement.md tells the story.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
from typing import Optional

from megatron_arpo.errors import InputError

RAY_FLOOR = (2, 50)
RAY_KEEPS_BY_DEFAULT = (2, 56)
OVERRIDE_ON_ZERO = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
ENGINE_RAY_ENV = {OVERRIDE_ON_ZERO: "0"}
RAY_FIX = f"pip install 'ray[default]>={RAY_FLOOR[0]}.{RAY_FLOOR[1]}' (setup.py's floor)"


class RayVersionError(InputError):
    """The installed Ray cannot run the engines as the trainer starts them."""


def installed_ray_version() -> Optional[str]:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


def parse_version(version: str) -> tuple[int, int]:
    """``2.55.1`` / ``2.56.0rc1`` / ``3.0.0.dev0`` -> (major, minor)."""
    match = re.match(r"^\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a Ray version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def ray_version_problem(version: str) -> Optional[str]:
    """One line naming the problem and the fix when ``version`` blanks CUDA_VISIBLE_DEVICES beyond repair."""
    if parse_version(version) >= RAY_FLOOR:
        return None
    return (f"ray {version} blanks CUDA_VISIBLE_DEVICES for num_gpus=0 actors (the vLLM engine actors when "
            f"rollout.tensor_parallel > 1), and only Ray >= {RAY_FLOOR[0]}.{RAY_FLOOR[1]} lets "
            f"{OVERRIDE_ON_ZERO}=0 keep it; {RAY_FIX}")


def check_ray_version(version: Optional[str] = None) -> None:
    """Raise ``RayVersionError`` (one line, with the fix) for a Ray older than ``RAY_FLOOR``."""
    version = installed_ray_version() if version is None else version
    if version is None:
        raise RayVersionError(f"ray is not installed; {RAY_FIX}")
    problem = ray_version_problem(version)
    if problem is not None:
        raise RayVersionError(problem)
