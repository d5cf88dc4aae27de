"""The ``launcher`` section of an experiment config: typed options, validation, and CLI overrides.

``launcher_options(cfg, overrides)`` accepts a plain mapping (the YAML ``launcher:`` section, or a whole
experiment dict that has one), a dataclass instance with the same field names (e.g. the ``launcher``
section of ``megatron_arpo.config``), or a ``LauncherOptions``; CLI overrides (``--nodes 4``) win.
Unknown keys are errors that list the allowed keys.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from megatron_arpo.cluster.allocation import resource_problems
from megatron_arpo.cluster.launch_options import PREEMPT_EXIT_CODE, LauncherSection  # noqa: F401
from megatron_arpo.cluster.ports import parse_port_range
from megatron_arpo.errors import InputError

@dataclass(frozen=True)
class LauncherOptions(LauncherSection):
    """The ``launcher`` section (every field and default: ``LauncherSection``) plus where the run lives.

    ``run_dir``: relative paths are relative to the submit directory; logs go to ``<run_dir>/logs``.
    Validated on construction.
    """

    run_dir: str = "runs/megatron-arpo"

    def __post_init__(self) -> None:
        validate_launcher_options(self)


class LauncherError(InputError):
    """A bad ``launcher`` setting or CLI override (the CLI exits 2)."""


def validate_launcher_options(opts: LauncherOptions) -> None:
    def bad(key: str, value: Any, allowed: str) -> LauncherError:
        return LauncherError(f"launcher.{key}: got {value!r}; allowed: {allowed}")

    for key in ("nodes", "gpus_per_node"):
        value = getattr(opts, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "nodes" else 0):
            raise bad(key, value, "an integer >= 1" if key == "nodes" else "an integer >= 0")
    if not isinstance(opts.max_requeues, int) or opts.max_requeues < 0:
        raise bad("max_requeues", opts.max_requeues, "an integer >= 0")
    if not isinstance(opts.signal_lead_seconds, int) or not 0 <= opts.signal_lead_seconds <= 65535:
        raise bad("signal_lead_seconds", opts.signal_lead_seconds, "an integer in 0..65535 (Slurm's limit)")
    if not isinstance(opts.preempt_exit_code, int) or not 1 <= opts.preempt_exit_code <= 125:
        raise bad("preempt_exit_code", opts.preempt_exit_code, "an integer in 1..125 (126+ mean shell/signal)")
    if not opts.job_name or any(c.isspace() for c in opts.job_name):
        raise bad("job_name", opts.job_name, "a non-empty name without spaces")
    if not opts.run_dir:
        raise bad("run_dir", opts.run_dir, "a directory path")
    if not isinstance(opts.ready_timeout, (int, float)) or opts.ready_timeout <= 0:
        raise bad("ready_timeout", opts.ready_timeout, "a positive number of seconds")
    if not isinstance(opts.env, dict) or not all(isinstance(k, str) for k in opts.env):
        raise bad("env", opts.env, "a mapping of environment variable names to values")

    for problem in resource_problems(opts):
        raise LauncherError(problem)
    try:
        parse_port_range(opts.ray_port_range)
    except ValueError as exc:
        raise LauncherError(str(exc)) from None


def _as_mapping(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, LauncherOptions):
        return dataclasses.asdict(cfg)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        if hasattr(cfg, "launcher"):  # a whole experiment config
            return _as_mapping(getattr(cfg, "launcher"))
        return dataclasses.asdict(cfg)
    if isinstance(cfg, Mapping):
        if "launcher" in cfg:  # a whole experiment config
            return _as_mapping(cfg["launcher"])
        return dict(cfg)
    raise LauncherError(f"launcher config must be a mapping or a dataclass, got {type(cfg).__name__}")


def launcher_options(cfg: Any = None, overrides: Mapping[str, Any] | None = None) -> LauncherOptions:
    """Build validated ``LauncherOptions``; ``overrides`` with value None are ignored (unset CLI flags)."""
    data = _as_mapping(cfg)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    allowed = {f.name for f in dataclasses.fields(LauncherOptions)}
    unknown = [k for k in data if k not in allowed]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise LauncherError(f"launcher: unknown key(s) {', '.join(hints)}; allowed keys: {sorted(allowed)}")
    return LauncherOptions(**data)
