"""What a command checks before it starts anything expensive: ``train``, ``config validate`` and ``launch``.

``find_problems(cfg, command)`` collects every problem at once, each one line naming the key and the fix:

- ``trainer.mode: off_policy`` against the placement and the rollout buffer (``config.off_policy_problems``);
- paths: the files and directories ``command`` reads exist (``megatron_arpo.config.validate_paths``);
- the checkpoint: ``model.hf_checkpoint``'s ``config.json`` agrees with ``model.config`` on every
  architecture field (all disagreeing fields named, with both values), and the tokenizer loads with a
  chat template (``model.tokenizer``, else the checkpoint);
- the tools, built as training builds them (each constructor validates its settings; the python tool
  runs one trivial program in its sandbox, so bubblewrap and user namespaces are probed), and the HTTP
  retriever sent one test query with a short timeout (an unreachable retriever is named);
- the data: the rows ``command`` reads are parsed and validated (``data.on_bad_row`` applies).

``preflight`` raises them together as one ``PreflightError`` (an ``InputError``: exit 2, one line per
problem). ``launch slurm|local`` runs it before submitting (``--no-preflight`` skips it), ``config
validate --paths COMMAND`` runs all of it, plain ``config validate`` the tool checks. The checks build
tools without their cache and call no model, so they write nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from megatron_arpo.config import BUILTIN_REWARDS, ConfigError, off_policy_problems, resolved_model, validate_paths
from megatron_arpo.data.chat import ChatFormatError, load_chat_format
from megatron_arpo.data.datasets import DEFAULT_SYSTEM_PROMPT, load_prompt_files
from megatron_arpo.data.fields import FieldKeys
from megatron_arpo.data.sft import SFTDataError, iter_conversations
from megatron_arpo.errors import InputError, first_line
from megatron_arpo.model_config import ARCH_FIELDS, MODEL_CONFIG_DIR, load_model_config, model_config_from_hf
from megatron_arpo.tools.base import ToolError, TransportError
from megatron_arpo.tools.containment import SandboxUnavailable
from megatron_arpo.tools.registry import build_python_tool, build_search_tool
from megatron_arpo.tools.search import HttpRetrieverBackend

logger = logging.getLogger(__name__)

Command = Literal["train", "sft", "eval"]

PROBE_TIMEOUT_S = 5.0  # the retriever's test query: long enough for a loaded server, short at submit time
# config.json fields compared as written (where present), before the parsed comparison of ARCH_FIELDS.
CHECKPOINT_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class PreflightError(ConfigError):
    """Every problem found before starting, one per line."""

    def __init__(self, problems: list[str]):
        self.errors, self.source = list(problems), None
        count = sum(not p.startswith("(") for p in problems)  # not the note on relative paths
        InputError.__init__(self, f"{count} problem(s) found before starting anything:\n"
                                  + "\n".join(f"  {p}" for p in problems))


def _close(tool: Any) -> None:
    close = getattr(tool, "close", None)
    if close is not None:
        result = close()
        if asyncio.iscoroutine(result):
            asyncio.run(result)


def tool_problems(cfg: Any, with_files: bool = True, probe: bool = True) -> list[str]:
    """Build every enabled tool of ``cfg.tools`` as training would; with ``probe``, query the HTTP retriever."""

    tools = cfg.to_dict()["tools"]
    builders = []
    if tools["python"]["enabled"]:
        builders.append(("tools.python", build_python_tool, tools["python"]))
    search = tools["search"]
    if search["enabled"] and (with_files or search["backend"] != "local"):
        builders.append(("tools.search", build_search_tool, search))
    errors = []
    for section, build, section_cfg in builders:
        try:
            tool = build(section_cfg)
        except (ValueError, OSError, SandboxUnavailable) as exc:  # the tool's own checks (bwrap probe included)
            errors.append(f"{section}: {exc}")
            continue
        _close(tool)
    if probe and search["enabled"] and search["backend"] == "http" and not any(e.startswith("tools.search")
                                                                              for e in errors):
        problem = probe_retriever(search["url"], max_response_bytes=search["max_response_bytes"])
        if problem:
            errors.append(problem)
    return errors


def check_tools(cfg: Any, with_files: bool = True, probe: bool = False) -> None:
    """``tool_problems`` as one ConfigError naming each section (what ``train`` runs before it starts)."""
    errors = tool_problems(cfg, with_files, probe)
    if errors:
        raise ConfigError(errors)


def probe_retriever(url: str, timeout_s: float = PROBE_TIMEOUT_S, max_response_bytes: int = 1 << 20) -> Optional[str]:
    """Send the retriever one test query; the problem as a line, or None when it answered."""

    backend = HttpRetrieverBackend(url, timeout_s=timeout_s, max_response_bytes=max_response_bytes)

    async def query() -> None:
        try:
            await asyncio.wait_for(backend.search("megatron-arpo preflight", 1), timeout_s)
        finally:
            await backend.close()

    try:
        asyncio.run(query())
    except (ToolError, TransportError, asyncio.TimeoutError, OSError) as exc:
        detail = str(exc) or type(exc).__name__
        return (f"tools.search.url: the retriever did not answer a test query within {timeout_s:g} s ({detail}); "
                f"start it, or point tools.search.url (--set tools.search.url=http://HOST:PORT/retrieve) at a "
                f"running one (a retriever that starts inside the job: launch with --no-preflight)")
    return None


def _matching_model_configs(hf_config: Mapping[str, Any]) -> list[str]:
    """Names of the shipped model configs whose architecture equals this config.json's."""
    try:
        theirs = model_config_from_hf(hf_config)
    except (ValueError, KeyError, TypeError):
        return []
    names = []
    for path in sorted(MODEL_CONFIG_DIR.glob("*.yaml")):
        try:
            ours = load_model_config(path)
        except (ValueError, OSError):
            continue
        if all(getattr(ours, key) == getattr(theirs, key) for key in ARCH_FIELDS):
            names.append(path.stem)
    return names


def checkpoint_mismatches(model_cfg: Any, hf_config: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, model config value, config.json value) for every architecture field that disagrees."""
    found = {}
    for key in CHECKPOINT_FIELDS:  # as written: also when the family cannot parse the file
        if key in hf_config and hf_config[key] != getattr(model_cfg, key):
            found[key] = (key, getattr(model_cfg, key), hf_config[key])
    try:
        theirs = model_config_from_hf(hf_config)
    except (ValueError, KeyError, TypeError):
        theirs = None
    if theirs is not None:
        for key in ARCH_FIELDS:
            if key not in found and getattr(model_cfg, key) != getattr(theirs, key):
                found[key] = (key, getattr(model_cfg, key), getattr(theirs, key))
    return list(found.values())


def checkpoint_problems(cfg: Any) -> list[str]:
    """``model.hf_checkpoint`` against ``model.config``, and the tokenizer with its chat template."""
    hf_dir = cfg.model.hf_checkpoint
    if not hf_dir or not Path(hf_dir).is_dir():
        return []  # missing: validate_paths names it
    problems = []
    path = Path(hf_dir) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
        if not isinstance(hf_config, dict):
            raise ValueError(f"expected a JSON object, got {type(hf_config).__name__}")
    except FileNotFoundError:
        problems.append(f"model.hf_checkpoint: {path} not found; point model.hf_checkpoint at a Hugging Face "
                        f"checkpoint directory (config.json, *.safetensors, tokenizer files)")
        hf_config = None
    except (OSError, ValueError) as exc:
        problems.append(f"model.hf_checkpoint: {path} is not readable JSON ({exc}); restore it from the original "
                        f"checkpoint")
        hf_config = None
    if hf_config is not None:
        try:
            model_cfg = resolved_model(cfg)
        except ConfigError as exc:
            problems.extend(exc.errors)
        else:
            off = checkpoint_mismatches(model_cfg, hf_config)
            if off:
                fields = ", ".join(f"{key} {theirs!r} (model.config: {ours!r})" for key, ours, theirs in off)
                matches = _matching_model_configs(hf_config)
                fix = (f"set model.config: {matches[0]}" if matches else
                       "point model.config at a model YAML with this checkpoint's values")
                problems.append(f"model.hf_checkpoint: {path} disagrees with model.config {cfg.model.config!r} on "
                                f"{len(off)} field(s): {fields}; {fix}, or model.hf_checkpoint at a "
                                f"{model_cfg.name} checkpoint")
    problems.extend(tokenizer_problems(cfg))
    return problems


def tokenizer_problems(cfg: Any) -> list[str]:
    """The tokenizer loads and has a chat template, as the trainer loads it."""
    key = "model.tokenizer" if cfg.model.tokenizer else "model.hf_checkpoint"
    tok_dir = Path(cfg.model.tokenizer or cfg.model.hf_checkpoint)
    if not tok_dir.is_dir():
        return []  # validate_paths names it
    if not any((tok_dir / name).exists() for name in TOKENIZER_FILES):
        return [f"{key}: {tok_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the base model's "
                f"tokenizer files there, or set model.tokenizer to a directory that has them"]
    # deferred: pulls in transformers (heavy; this module imports without it)
    from transformers import AutoTokenizer  # heavy (seconds): only when there are tokenizer files to load


    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        load_chat_format(tokenizer, cfg.model.hf_checkpoint, tokenizer_dir=cfg.model.tokenizer,
                         chat_template_file=cfg.data.chat_template, enable_thinking=cfg.data.enable_thinking)
    except ChatFormatError as exc:
        return [f"{key}: {exc}"]
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        return [f"{key}: cannot load the tokenizer in {tok_dir} ({first_line(exc)}); restore the tokenizer files of the base "
                f"model, or set model.tokenizer"]
    return []


def check_data(cfg: Any, command: Command) -> None:
    """Parse and validate the rows ``command`` reads; DatasetError / SFTDataError name the file and row."""
    if command == "train":
        d = cfg.data
        for files in (d.train_files, d.val_files):
            if files:
                load_prompt_files(files, fmt=d.format, on_bad_row=d.on_bad_row,
                                  system_prompt=d.system_prompt or DEFAULT_SYSTEM_PROMPT,
                                  strict_answers=d.reward in BUILTIN_REWARDS,
                                  prompt_key=d.prompt_key, answer_key=d.answer_key)
    elif command == "sft":
        keys = FieldKeys(cfg.data.prompt_key, cfg.data.answer_key)
        if sum(1 for _ in iter_conversations(cfg.sft.train_files, cfg.data.on_bad_row, keys=keys)) == 0:
            raise SFTDataError(f"no usable SFT conversation in {cfg.sft.train_files}")


def find_problems(cfg: Any, command: Optional[Command], *, data: bool = True, probe: bool = True,
                  tools: bool = True) -> list[str]:
    """Every problem ``command`` would stop on, one line each (``command`` None: the model and tools only)."""
    problems: list[str] = []
    if command == "train":  # a config built around validate (dataclasses.replace) still gets these refusals
        problems.extend(off_policy_problems(cfg))
    try:
        validate_paths(cfg, for_command=command or "sft")
    except ConfigError as exc:
        found = [e for e in exc.errors if not (command is None and e.startswith("sft."))]
        if any(not e.startswith("(") for e in found):  # not only the note on relative paths
            problems.extend(found)
    if cfg.model.hf_checkpoint:
        problems.extend(checkpoint_problems(cfg))
    if tools and command in ("train", "eval", None):
        problems.extend(tool_problems(cfg, with_files=True, probe=probe))
    if data and command in ("train", "sft") and not any(p.startswith(("data.", "sft.")) for p in problems):
        try:
            check_data(cfg, command)
        except InputError as exc:
            problems.append(str(exc).replace("\n", " "))
    return problems


def preflight(cfg: Any, command: Optional[Command], *, data: bool = True, probe: bool = True,
              tools: bool = True) -> None:
    """``find_problems``, raised together as one PreflightError."""
    problems = find_problems(cfg, command, data=data, probe=probe, tools=tools)
    if problems:
        raise PreflightError(problems)
