"""Experiment configuration: typed dataclasses per process, YAML loading, ``--set`` overrides, validation.

An experiment YAML has one mapping per section; sections mirror the processes that read them:
``model`` (which architecture and checkpoint), ``actor`` (Megatron training ranks), ``rollout`` (vLLM
engines and the ARPO/AEPO branching scheduler), ``algorithm`` (advantage, loss, KL), ``tools``,
``data``, ``trainer`` (the driver loop, placement, checkpoint cadence), ``logging``, ``launcher``
(Slurm/Ray), plus ``sft`` (cold-start SFT) and ``eval`` (``megatron-arpo eval`` defaults).

Rules this module enforces, all in ``load_config``:
- Unknown keys are errors with a "did you mean" suggestion; values are coerced from the dataclass
  annotations (YAML values and ``--set a.b=c`` strings go through the same coercion).
- Range and cross-section checks (``rollout.initial_rollouts <= rollout.n``, TP divides the head
  counts, ...) are collected and raised together as one ``ConfigError`` naming every key path.
- File existence is checked separately by ``validate_paths`` so ``config show`` works without data.
- ``null`` for ``actor.tensor_parallel``/``pipeline_parallel`` and ``rollout.tensor_parallel`` means
  "the model config's default for its size"; ``trainer.run_dir: null`` means ``runs/<name>``. Both are
  filled in at load time, so the dumped config is fully resolved.
- Relative paths inside the config are relative to the working directory, except ``base:``, which is
  relative to the file that names it. A file with ``base: other.yaml`` deep-merges over that file.
- No secrets: API keys are read from environment variables whose NAMES the config holds
  (``*_env`` keys). ``redact`` (megatron_arpo/redaction.py) masks secret-looking values and URL
  passwords before a config reaches a log or wandb.

The numbers given as defaults are the ARPO reference's (docs/design/arpo_reference.md §2.1, §3.3) unless noted.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
import math
import os
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence, Union, get_args, get_origin, get_type_hints

import yaml

from megatron_arpo.determinism import deterministic_problems
from megatron_arpo.errors import ConfigError
from megatron_arpo.model_config import ModelConfig, load_model_config
from megatron_arpo.parallel_layout import ParallelLayout, layout_errors
from megatron_arpo.redaction import REDACTED, is_secret_key, redact  # noqa: F401  (re-exported)
from megatron_arpo.config_schema import (  # noqa: F401  (re-exported: the public config API)
    _f,
    BUILTIN_REWARDS,
    ModelSection,
    OptimizerSection,
    ActorCheckpointSection,
    ActorSection,
    RolloutSection,
    KLSection,
    AlgorithmSection,
    PythonToolSection,
    SearchToolSection,
    ToolCacheSection,
    ToolsSection,
    DataSection,
    TimeoutsSection,
    TrainerSection,
    WandbSection,
    LoggingSection,
    LauncherSection,
    SFTSection,
    JudgeSection,
    EvalSection,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- experiment
@dataclass(frozen=True)
class ExperimentConfig:
    name: str = _f("default", help="experiment name (run dir, wandb run name)")
    model: ModelSection = _f(factory=ModelSection)
    actor: ActorSection = _f(factory=ActorSection)
    rollout: RolloutSection = _f(factory=RolloutSection)
    algorithm: AlgorithmSection = _f(factory=AlgorithmSection)
    tools: ToolsSection = _f(factory=ToolsSection)
    data: DataSection = _f(factory=DataSection)
    trainer: TrainerSection = _f(factory=TrainerSection)
    logging: LoggingSection = _f(factory=LoggingSection)
    launcher: LauncherSection = _f(factory=LauncherSection)
    sft: SFTSection = _f(factory=SFTSection)
    eval: EvalSection = _f(factory=EvalSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def redacted(self) -> dict[str, Any]:
        return redact(self.to_dict())

    def with_overrides(self, overrides: Sequence[str]) -> "ExperimentConfig":
        """A new validated config with ``a.b=c`` overrides applied on top of this one.

        Overrides apply to the mapping this config was built from (before ``null`` values were
        resolved), so ``rollout.response_length=512`` also moves a derived ``rollout.max_model_len``.
        """
        raw = copy.deepcopy(getattr(self, "_raw", None) or self.to_dict())
        errors: list[str] = []
        for item in overrides:
            _apply_override(raw, item, errors)
        if errors:
            raise ConfigError(errors)
        return build_config(raw)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.run_dir or f"runs/{self.name}")

    @functools.cached_property
    def layout(self) -> ParallelLayout:
        """The parallel layout (`megatron_arpo.parallel_layout`), checked and computed once per config."""
        errors = layout_errors(self, resolved_model(self))
        if errors:  # a config changed after it was built (dataclasses.replace) is checked here
            raise ConfigError(errors)
        return ParallelLayout.from_config(self)

    @property
    def max_sequence_tokens(self) -> int:
        """Prompt plus response: the longest sequence the actor and the engines must hold."""
        return self.data.max_prompt_tokens + self.rollout.response_length


def resolved_model(cfg: ExperimentConfig) -> ModelConfig:
    """The architecture ``model.config`` names, as a validated ModelConfig."""
    if not cfg.model.config:
        raise ConfigError(["model.config: required; give a model_configs/ name (e.g. qwen3-8b, tiny-qwen3) "
                           "or a model YAML path"])
    try:
        return load_model_config(cfg.model.config)
    except (ValueError, FileNotFoundError, OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"model.config: {exc}"]) from exc


# ---------------------------------------------------------------------------------- coercion/build
_NONE_STRINGS = {"none", "null", "~"}
_TRUE_STRINGS = {"true", "yes", "on", "1"}
_FALSE_STRINGS = {"false", "no", "off", "0"}
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_INT_RE = re.compile(r"^[+-]?\d+$")
# No integer setting means anything beyond this (bytes of memory included); `rollout.n: 1e30` is a typo.
_INT_LIMIT = 10**15


class _Invalid(Exception):
    """Raised inside coercion; the builder records it with the key path and carries on."""


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _coerce(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_STRINGS):
            return None
        return _coerce(value, inner[0], path, errors)
    if dataclasses.is_dataclass(tp):
        return _build_section(tp, value, path, errors)
    if value is None:
        raise _Invalid(f"must not be null; expected {_type_name(tp)}")
    if origin is Literal:
        if isinstance(value, bool) and str(value).lower() in args:
            return str(value).lower()  # YAML reads `use_te: true` as a bool
        if {"true", "false"} <= set(args) and str(value).strip().lower() in _TRUE_STRINGS | _FALSE_STRINGS:
            return "true" if str(value).strip().lower() in _TRUE_STRINGS else "false"  # yes/no/1/0 as for a bool
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _Invalid(f"{value!r} is not allowed{hint}; allowed: {list(args)}")
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = yaml.safe_load(text)
                except yaml.YAMLError as exc:
                    raise _Invalid(f"cannot parse list {text!r}: {exc}") from None
            else:
                value = [part.strip() for part in text.split(",") if part.strip()]
        if not isinstance(value, list):
            raise _Invalid(f"expected a list, got {_describe(value)}")
        out = []
        for i, item in enumerate(value):
            try:
                out.append(_coerce(item, args[0], f"{path}[{i}]", errors))
            except _Invalid as exc:
                errors.append(f"{path}[{i}]: {exc}")
        return out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _Invalid(f"expected a mapping, got {_describe(value)}")
        out = {}
        for key, item in value.items():
            if isinstance(item, (int, float)) and not isinstance(item, bool) and args[1] is str:
                item = str(item)  # env values: OMP_NUM_THREADS: 1
            try:
                out[str(key)] = _coerce(item, args[1], f"{path}.{key}", errors)
            except _Invalid as exc:
                errors.append(f"{path}.{key}: {exc}")
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS | _FALSE_STRINGS:
            return value.strip().lower() in _TRUE_STRINGS
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise _Invalid(f"expected a boolean (true/false/yes/no/1/0), got {_describe(value)}")
    if tp is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        elif isinstance(value, str) and _INT_RE.match(value.strip()):
            number = int(value.strip())
        elif isinstance(value, str) and _FLOAT_RE.match(value.strip()) and float(value).is_integer():
            number = int(float(value))  # `1e3` written without a dot
        if number is None:
            raise _Invalid(f"expected an integer, got {_describe(value)}")
        if abs(number) > _INT_LIMIT:
            raise _Invalid(f"{value!r} is not a usable integer (more than {_INT_LIMIT:.0e}); check the value")
        return number
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        # PyYAML reads `1e-6` (no dot) as a string; accept any float literal.
        elif isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            number = float(value.strip())
        if number is None:
            raise _Invalid(f"expected a number, got {_describe(value)}")
        if not math.isfinite(number):
            raise _Invalid(f"{value!r} is not a finite number; give a real value")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Invalid(f"expected a string, got {_describe(value)}; quote the value in YAML")
    raise TypeError(f"config.py: no coercion for annotation {tp!r} at {path}")  # a bug here, not user error


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


_BOUNDS = (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
           ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b))


def _check_bounds(value: Any, meta: Mapping[str, Any]) -> str | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    active = [(word, meta[key], ok) for key, word, ok in _BOUNDS if meta.get(key) is not None]
    if all(ok(value, bound) for _, bound, ok in active):
        return None
    return f"{value!r} is out of range; allowed: {' and '.join(f'{w} {b}' for w, b, _ in active)}"


# Keys that existed once: saying why they went beats "unknown key".
REMOVED_KEYS = {
    "actor.checkpoint.async_save": "removed: saves are synchronous, because a checkpoint must be complete before "
                                   "a preempted job exits and before old ones are pruned; delete the key",
}


def _unknown_key_message(path: str, key: str, allowed: Sequence[str]) -> str:
    full = f"{path}.{key}" if path else key
    if full in REMOVED_KEYS:
        return f"{full}: {REMOVED_KEYS[full]}"
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    if close:
        return f"{full}: unknown key (did you mean {(path + '.' if path else '') + close[0]!r}?)"
    return f"{full}: unknown key; allowed keys under {path or 'the top level'}: {', '.join(allowed)}"


def _build_section(cls: type, data: Any, path: str, errors: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise _Invalid(f"expected a mapping of {cls.__name__} keys, got {_describe(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            errors.append(_unknown_key_message(path, str(key), list(fields)))
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        sub = f"{path}.{name}" if path else name
        try:
            value = _coerce(data[name], hints[name], sub, errors)
        except _Invalid as exc:
            errors.append(f"{sub}: {exc}")
            continue
        problem = _check_bounds(value, f.metadata)
        if problem:
            errors.append(f"{sub}: {problem}")
            continue
        kwargs[name] = value
    return cls(**kwargs)


def _set_path(raw: dict, keys: list[str], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value


def _apply_override(raw: dict, item: str, errors: list[str]) -> None:
    """Apply one ``a.b=c`` to the raw dict after checking the key path against the dataclasses."""
    if "=" not in item:
        errors.append(f"override {item!r}: expected KEY=VALUE, e.g. rollout.n=8")
        return
    dotted, value = item.split("=", 1)
    keys = dotted.strip().split(".")
    cls: Any = ExperimentConfig
    for depth, key in enumerate(keys):
        prefix = ".".join(keys[:depth])
        if get_origin(cls) is dict:  # free-form mapping (launcher.env): the rest is the dict key
            if depth != len(keys) - 1:
                errors.append(f"{dotted}: {prefix} is a mapping of strings; nothing nests below {prefix}.{key}")
                return
            break
        if not dataclasses.is_dataclass(cls):
            errors.append(f"{dotted}: {prefix} is a value, not a section")
            return
        fields = get_type_hints(cls)
        if key not in fields:
            errors.append(_unknown_key_message(prefix, key, list(fields)))
            return
        cls = fields[key]
        if get_origin(cls) in (Union, types.UnionType) and depth < len(keys) - 1:
            cls = next(a for a in get_args(cls) if a is not type(None))  # Optional[section]: go inside
    if dataclasses.is_dataclass(cls):
        errors.append(f"{dotted}: is a section; set one of its keys, e.g. {dotted}.{dataclasses.fields(cls)[0].name}=...")
        return
    _set_path(raw, keys, value)


def _deep_merge(base: dict, top: Mapping) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key]}, again on line {line}); "
                    f"keep one", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml_file(path: str | os.PathLike, what: str = "YAML file") -> Any:
    """Parse a YAML file strictly (UTF-8, no duplicate keys); every failure is a one-line ConfigError."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{what} {str(path)!r} not found"]) from None
    except IsADirectoryError:
        raise ConfigError([f"{what} {str(path)!r} is a directory; pass the YAML file inside it"]) from None
    except PermissionError:
        raise ConfigError([f"{what} {str(path)!r} is not readable (permission denied)"]) from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError([f"not UTF-8 text: byte 0x{exc.object[exc.start]:02x} on line {line}; save the file "
                           f"as UTF-8"], source=str(path)) from None
    except OSError as exc:
        raise ConfigError([f"{what} {str(path)!r} cannot be read: {exc.strerror or exc}"]) from None
    loader = _StrictLoader(text)
    loader.name = path.name  # error marks say `in "exp.yaml", line 3, column 5`
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        kind = "YAML error" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
        raise ConfigError([f"{kind}: {' '.join(str(exc).split())}"], source=str(path)) from None
    finally:
        loader.dispose()


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError([f"base: include cycle {chain}"], source=str(seen[0]))
    data = read_yaml_file(path, "config file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping of sections at the top level, got {type(data).__name__}"],
                          source=str(path))
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError([f"base: expected a relative YAML path, got {_describe(base)}"], source=str(path))
    parent = _read_yaml(path.parent / base, (*seen, path))
    return _deep_merge(parent, data)


def build_config(raw: Mapping[str, Any], source: str | None = None) -> ExperimentConfig:
    """Coerce, resolve and validate a raw mapping; raise one ConfigError listing every problem."""
    errors: list[str] = []
    try:
        cfg = _build_section(ExperimentConfig, raw, "", errors)
    except _Invalid as exc:
        raise ConfigError([str(exc)], source=source) from None
    if errors:
        raise ConfigError(errors, source=source)
    try:
        cfg = _resolve_defaults(cfg)
        errors = validate(cfg)
    except ConfigError as exc:
        raise ConfigError(exc.errors, source=source) from exc
    if errors:
        raise ConfigError(errors, source=source)
    # Kept out of the dataclass fields (so out of to_dict and ==) for with_overrides.
    object.__setattr__(cfg, "_raw", copy.deepcopy(dict(raw)))
    return cfg


def with_absolute_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """The config with model paths made absolute: Ray workers do not share the driver's working dir."""
    overrides = [f"{key}={Path(value).resolve()}" for key, value in
                 (("model.hf_checkpoint", cfg.model.hf_checkpoint), ("model.tokenizer", cfg.model.tokenizer),
                  ("trainer.run_dir", cfg.trainer.run_dir)) if value]
    return cfg.with_overrides(overrides)


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read an experiment YAML (following ``base:``), apply ``a.b=c`` overrides, resolve and validate."""
    raw = _read_yaml(Path(path))
    errors: list[str] = []
    for item in overrides:
        _apply_override(raw, item, errors)
    if errors:
        raise ConfigError(errors, source=f"{path} (--set)")
    return build_config(raw, source=str(path))


# ---------------------------------------------------------------------------------- resolve/validate
def _resolve_defaults(cfg: ExperimentConfig) -> ExperimentConfig:
    """Fill the ``null`` = "derived" fields so the resolved config states every value it runs with."""
    model = resolved_model(cfg)
    rep = dataclasses.replace
    actor, rollout, trainer = cfg.actor, cfg.rollout, cfg.trainer
    if actor.tensor_parallel is None:
        actor = rep(actor, tensor_parallel=model.defaults.actor_tensor_parallel)
    if actor.pipeline_parallel is None:
        actor = rep(actor, pipeline_parallel=model.defaults.actor_pipeline_parallel)
    if rollout.tensor_parallel is None:
        rollout = rep(rollout, tensor_parallel=model.defaults.rollout_tensor_parallel)
    if rollout.max_model_len is None:
        rollout = rep(rollout, max_model_len=cfg.data.max_prompt_tokens + rollout.response_length)
    if trainer.run_dir is None:
        trainer = rep(trainer, run_dir=f"runs/{cfg.name}")
    if rollout.buffer_groups is None:
        rollout = rep(rollout, buffer_groups=(rollout.max_staleness + 1) * trainer.train_batch_size)
    # tools.cache.path stays null here: "node-local" is decided on the node that runs the trainer
    # (megatron_arpo.trainer.checkpointing.tool_cache_path), not where the config is resolved.
    return rep(cfg, actor=actor, rollout=rollout, trainer=trainer)


_ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def config_warnings(cfg: ExperimentConfig) -> list[str]:
    """Settings that are valid but weaken a safety guarantee; `config validate` prints each one."""
    python = cfg.tools.python
    if not python.enabled:
        return []
    found = []
    if not python.isolate_network:
        found.append("tools.python.isolate_network: false shares the host's network with model-written code "
                     "(it can reach every service this machine can); set it to true unless the code needs it")
    if python.sandbox == "best_effort":
        found.append("tools.python.sandbox: best_effort runs model-written code WITHOUT isolation wherever the "
                     "sandbox cannot start; set it to required (the default) to refuse such a machine instead")
    return found


def routing_replay_problems(cfg: ExperimentConfig, model: ModelConfig) -> list[str]:
    """``actor.moe_routing_replay`` against the model and the actor settings (docs/moe.md)."""
    a = cfg.actor
    if a.moe_replay_diagnostics and not a.moe_routing_replay:
        return ["actor.moe_replay_diagnostics compares the actor's log-probs with and without routing replay; "
                "set actor.moe_routing_replay: true, or actor.moe_replay_diagnostics: false"]
    if not a.moe_routing_replay:
        return []
    if not model.is_moe:
        return [f"actor.moe_routing_replay: {model.name} is a dense model (no routed experts); set "
                f"actor.moe_routing_replay: false"]
    if a.recompute != "none":
        return [f"actor.moe_routing_replay with actor.recompute: {a.recompute}: the recomputed forward would route "
                f"again after the next micro-batch's routing is set; set actor.recompute: none"]
    return []


def validate(cfg: ExperimentConfig) -> list[str]:
    """Cross-section checks on a resolved config; returns the list of problems (empty = valid)."""
    errors: list[str] = []
    model = resolved_model(cfg)
    a, r, alg, d, t = cfg.actor, cfg.rollout, cfg.algorithm, cfg.data, cfg.trainer

    # Actor and engine parallelism against the architecture and the devices.
    errors += layout_errors(cfg, model)
    if t.placement == "separate":
        for key, on in (("rollout.enable_sleep_mode", r.enable_sleep_mode), ("actor.offload", a.offload)):
            if on:
                errors.append(f"{key}: true frees GPU memory for the other side of a colocated GPU, but "
                              f"trainer.placement is 'separate' (actor and engines own their GPUs); set {key}: "
                              f"false, or trainer.placement: colocated")

    errors += off_policy_problems(cfg)
    errors += routing_replay_problems(cfg, model)

    # Sequence budgets.
    seq = cfg.max_sequence_tokens
    if seq > model.max_position_embeddings:
        errors.append(f"rollout.response_length: data.max_prompt_tokens + response_length = {seq} exceeds "
                      f"{model.name} max_position_embeddings {model.max_position_embeddings}")
    if r.max_model_len < seq:
        errors.append(f"rollout.max_model_len: {r.max_model_len} is below data.max_prompt_tokens + "
                      f"rollout.response_length = {seq}; set it >= {seq} or null")
    for key in ("micro_batch_tokens", "logprob_micro_batch_tokens"):
        budget = getattr(a, key)
        if budget is not None and budget < seq:
            errors.append(f"actor.{key}: {budget} cannot hold one full sequence of {seq} tokens "
                          f"(data.max_prompt_tokens + rollout.response_length); set it >= {seq}")

    # Rollout budget.
    if r.initial_rollouts > r.n:
        errors.append(f"rollout.initial_rollouts: {r.initial_rollouts} exceeds rollout.n {r.n}; allowed: 1..{r.n}")
    if r.beam_size > r.n:
        errors.append(f"rollout.beam_size: {r.beam_size} exceeds rollout.n {r.n}; allowed: 1..{r.n}")
    if r.entropy_window > r.response_length:
        errors.append(f"rollout.entropy_window: {r.entropy_window} exceeds rollout.response_length {r.response_length}")

    # Batching.
    if t.train_batch_size % a.mini_batch_size:
        errors.append(f"actor.mini_batch_size: {a.mini_batch_size} does not divide trainer.train_batch_size "
                      f"{t.train_batch_size}; allowed: divisors of {t.train_batch_size}")

    # Algorithm.
    if alg.kl.coef > 0 and not alg.use_reference:
        errors.append(f"algorithm.kl.coef: {alg.kl.coef} needs reference log-probs; set algorithm.use_reference: true")

    # Tools.
    tools, s = cfg.tools, cfg.tools.search
    tags = [tools.python.tag, s.tag]
    if tags[0] == tags[1]:
        errors.append(f"tools.search.tag: {s.tag!r} is also tools.python.tag; tags must differ")
    for key, tag in (("tools.python.tag", tags[0]), ("tools.search.tag", tags[1])):
        if not re.match(r"^[a-z_][a-z0-9_]*$", tag):
            errors.append(f"{key}: {tag!r} is not a valid tag name; allowed: lowercase letters, digits, _")
    if s.enabled:
        if s.backend == "local" and not s.corpus:
            errors.append("tools.search.corpus: required when tools.search.backend is 'local' (a JSONL corpus); "
                          "or set tools.search.enabled: false")
        if s.backend == "http" and not s.url:
            errors.append("tools.search.url: required when tools.search.backend is 'http'")
    if tools.cache is not None and tools.cache.path:
        real = os.path.realpath(os.path.abspath(tools.cache.path))
        for top in ("/proc", "/sys", "/dev"):
            if real == top or real.startswith(top + "/"):
                errors.append(f"tools.cache.path: {tools.cache.path!r} is under {top}, a kernel pseudo-filesystem; "
                              "set it to a file on disk, or null for the default under the run directory")
    if tools.python.enabled and tools.python.timeout_s > tools.timeout_s:
        errors.append(f"tools.python.timeout_s: {tools.python.timeout_s} exceeds tools.timeout_s {tools.timeout_s}, "
                      f"which would cut every long run short; keep it below")
    for key, name in (("tools.search.api_key_env", s.api_key_env), ("eval.judge.api_key_env", cfg.eval.judge.api_key_env)):
        if not _ENV_NAME_RE.match(name):
            errors.append(f"{key}: {name[:4] + '...' if len(name) > 8 else name!r} is not an environment variable "
                          f"NAME (like BRIGHT_DATA_API_KEY); keys never go in the config, export them instead")
    if cfg.eval.judge.enabled and not cfg.eval.judge.url:
        errors.append("eval.judge.url: required when eval.judge.enabled is true")
    if cfg.eval.judge.url and not cfg.eval.judge.url.startswith(("http://", "https://")):
        errors.append(f"eval.judge.url: {cfg.eval.judge.url!r} must start with http:// or https://")

    # Data, trainer, launcher.
    if not (d.reward in BUILTIN_REWARDS or re.match(r"^[\w.]+:\w+$", d.reward)):
        errors.append(f"data.reward: {d.reward!r} is neither a built-in reward {list(BUILTIN_REWARDS)} nor a "
                      f"'package.module:function' path")
    if not t.resume.strip():
        errors.append("trainer.resume: empty; allowed: auto | none | PATH of a checkpoint")
    la = cfg.launcher
    errors.extend(_launcher_port_problems(la))
    # deferred: every command imports this module at start-up; only validation needs it
    from megatron_arpo.cluster.allocation import resource_problems

    errors.extend(resource_problems(la))
    if not la.job_name or any(c.isspace() for c in la.job_name):
        errors.append(f"launcher.job_name: {la.job_name!r}; allowed: a non-empty name without spaces")
    if not re.match(r"^(\d+-)?\d+(:\d{1,2}){0,2}$", la.time):
        errors.append(f"launcher.time: {la.time!r} is not a Slurm time; allowed: MM, HH:MM:SS or D-HH:MM:SS")
    errors.extend(deterministic_problems(cfg))
    for name in cfg.launcher.env:
        if is_secret_key(name):
            errors.append(f"launcher.env.{name}: secrets must not be written in config files; export {name} "
                          f"in the submitting shell instead")
    return errors


def off_policy_problems(cfg: ExperimentConfig) -> list[str]:
    """``trainer.mode: off_policy`` against the placement and the buffer (also run by preflight)."""
    t, r = cfg.trainer, cfg.rollout
    errors = []
    if r.max_staleness < 0:
        errors.append(f"rollout.max_staleness: {r.max_staleness} is below 0; allowed: 0 (on-policy) or more "
                      f"policy versions")
    if r.in_flight_updates and (t.mode != "off_policy" or r.max_staleness < 1):
        errors.append(f"rollout.in_flight_updates: true needs trainer.mode: off_policy and rollout.max_staleness >= 1 "
                      f"(got mode {t.mode}, max_staleness {r.max_staleness}): with no staleness allowed no call can run "
                      "through a weight sync. Set rollout.max_staleness: 1 or more, or rollout.in_flight_updates: false")
    if t.mode != "off_policy":
        return errors
    if t.placement == "colocated":
        errors.append("trainer.mode: off_policy needs trainer.placement: separate; colocated engines and actor "
                      "ranks share the GPUs and take turns on them, so generation and training cannot overlap. Set "
                      "trainer.placement: separate (with trainer.actor_devices and trainer.rollout_devices), or "
                      "trainer.mode: sync")
    if r.buffer_groups is not None and r.buffer_groups < t.train_batch_size:
        errors.append(f"rollout.buffer_groups: {r.buffer_groups} cannot hold one batch of "
                      f"trainer.train_batch_size = {t.train_batch_size} prompt groups; set it >= "
                      f"{t.train_batch_size} or null (= (max_staleness + 1) x train_batch_size)")
    return errors


def _launcher_port_problems(la: LauncherSection) -> list[str]:
    # deferred: every command imports this module at start-up; only validation needs it
    from megatron_arpo.cluster.ports import parse_port_range

    errors = []
    try:
        lo, hi = parse_port_range(la.ray_port_range)
    except ValueError as exc:
        return [str(exc)]
    if la.ray_node_port_base is None:
        blocks = (hi - lo + 1) // la.ray_ports_per_node
        if blocks < la.nodes:
            errors.append(f"launcher.ray_port_range: {la.ray_port_range} holds {blocks} blocks of "
                          f"{la.ray_ports_per_node} ports but {la.nodes} nodes need {la.nodes}; widen it or lower "
                          f"launcher.ray_ports_per_node")
        return errors
    base = la.ray_node_port_base
    top = base + la.nodes * la.ray_ports_per_node - 1
    if top > 65535:
        errors.append(f"launcher.ray_node_port_base: {la.nodes} nodes x {la.ray_ports_per_node} ports from "
                      f"{base} end at {top} > 65535; lower ray_node_port_base or ray_ports_per_node")
    for key in ("ray_gcs_port", "ray_client_server_port"):
        value = getattr(la, key)
        if value is not None and base <= value <= top:
            errors.append(f"launcher.{key}: {value} falls inside the per-node port blocks {base}-{top}")
    if la.ray_gcs_port is not None and la.ray_gcs_port == la.ray_client_server_port:
        errors.append(f"launcher.ray_client_server_port: {la.ray_client_server_port} equals launcher.ray_gcs_port")
    return errors


def validate_paths(cfg: ExperimentConfig, *, for_command: Literal["train", "sft", "eval"] = "train") -> None:
    """Check that the files a run reads exist; raise one ConfigError listing each missing path."""
    errors: list[str] = []

    def need(key: str, value: str | None, kind: str = "file") -> None:
        if value is None:
            return
        p = Path(value)
        if kind == "file" and p.is_dir():
            errors.append(f"{key}: {value!r} is a directory; give the file")
        elif kind == "dir" and p.is_file():
            errors.append(f"{key}: {value!r} is a file; give the directory")
        elif not (p.is_dir() if kind == "dir" else p.exists()):
            broken = " (a broken symlink or a symlink loop)" if p.is_symlink() or not p.parent.exists() and \
                p.parent.is_symlink() else ""
            errors.append(f"{key}: {kind} {value!r} not found{broken}")

    need("model.hf_checkpoint", cfg.model.hf_checkpoint, "dir")
    need("model.tokenizer", cfg.model.tokenizer, "dir")
    if for_command == "train":
        if not cfg.data.train_files:
            errors.append("data.train_files: empty; list at least one parquet/JSONL file")
        for i, f in enumerate(cfg.data.train_files):
            need(f"data.train_files[{i}]", f)
        for i, f in enumerate(cfg.data.val_files):
            need(f"data.val_files[{i}]", f)
        if cfg.model.hf_checkpoint is None:
            errors.append("model.hf_checkpoint: required to train; point it at an HF checkpoint directory")
    if for_command == "sft":
        if not cfg.sft.train_files:
            errors.append("sft.train_files: empty; list at least one ShareGPT-style JSON/JSONL file")
        for i, f in enumerate(cfg.sft.train_files):
            need(f"sft.train_files[{i}]", f)
    if for_command == "eval":
        need("eval.data_dir", cfg.eval.data_dir, "dir")
    if for_command in ("train", "eval") and cfg.tools.search.enabled and cfg.tools.search.backend == "local":
        need("tools.search.corpus", cfg.tools.search.corpus)
    if errors:
        errors.append(f"(relative paths are relative to the working directory {os.getcwd()})")
        raise ConfigError(errors)


# ---------------------------------------------------------------------------------------- reference
def describe_fields(cls: type = ExperimentConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key path, type, default, help) for every leaf key: the source of the config reference in docs/configuration.md."""
    rows = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        inner = [a for a in get_args(tp) if dataclasses.is_dataclass(a)]  # Optional[section]
        if dataclasses.is_dataclass(tp) or inner:
            rows.extend(describe_fields(inner[0] if inner else tp, path + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        name = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
        rows.append((path, name, default, f.metadata.get("help", "")))
    return rows
