"""What a command checks before it starts anything expensive, shared with ``megatron-arpo config validate``.

``train`` refuses a run whose tools cannot work on this machine — a sandbox that cannot start (no
bubblewrap, no user namespaces: the python tool probes it), a sandbox user that is root or does not exist,
a missing interpreter, an unset web-search key, a retriever URL that is not http(s) — and whose
files are missing or malformed. ``config validate`` must refuse the same configs, so both call these
functions, and the tool checks are the tools package's own: the tools are *constructed* (each
constructor validates its settings, see ``megatron_arpo.tools``), never called, and without the cache,
so a check writes nothing.

- ``check_tools(cfg, with_files)``: every enabled tool is built; ``with_files=False`` (``config validate``
  without ``--paths``) skips the local search backend, whose only check is that its corpus file exists.
- ``check_data(cfg, command)``: the dataset rows ``command`` would read are parsed and validated
  (``data.on_bad_row`` applies), without a tokenizer.
- ``preflight(cfg, command)``: paths, tools and data — what ``config validate --paths COMMAND`` runs.

Every problem is raised as an ``InputError`` (``ConfigError`` for settings), which the CLI turns into one
line on stderr and exit code 2.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from megatron_arpo.config import BUILTIN_REWARDS, ConfigError, validate_paths

logger = logging.getLogger(__name__)

Command = Literal["train", "sft", "eval"]


def _close(tool: Any) -> None:
    close = getattr(tool, "close", None)
    if close is not None:
        result = close()
        if asyncio.iscoroutine(result):
            asyncio.run(result)


def check_tools(cfg: Any, with_files: bool = True) -> None:
    """Construct every enabled tool of ``cfg.tools`` as training would; ConfigError naming the section."""
    from megatron_arpo.tools.containment import SandboxUnavailable
    from megatron_arpo.tools.registry import build_python_tool, build_search_tool

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
    if errors:
        raise ConfigError(errors)


def check_data(cfg: Any, command: Command) -> None:
    """Parse and validate the rows ``command`` reads; DatasetError / SFTDataError name the file and row."""
    if command == "train":
        from megatron_arpo.data.datasets import DEFAULT_SYSTEM_PROMPT, load_prompt_files

        d = cfg.data
        for files in (d.train_files, d.val_files):
            if files:
                load_prompt_files(files, fmt=d.format, on_bad_row=d.on_bad_row,
                                  system_prompt=d.system_prompt or DEFAULT_SYSTEM_PROMPT,
                                  strict_answers=d.reward in BUILTIN_REWARDS,
                                  prompt_key=d.prompt_key, answer_key=d.answer_key)
    elif command == "sft":
        from megatron_arpo.data.sft import SFTDataError, iter_conversations

        from megatron_arpo.data.fields import FieldKeys

        keys = FieldKeys(cfg.data.prompt_key, cfg.data.answer_key)
        if sum(1 for _ in iter_conversations(cfg.sft.train_files, cfg.data.on_bad_row, keys=keys)) == 0:
            raise SFTDataError(f"no usable SFT conversation in {cfg.sft.train_files}")


def preflight(cfg: Any, command: Command) -> None:
    """Paths, tools and data of ``command``: everything it would refuse before starting work."""
    validate_paths(cfg, for_command=command)
    if command in ("train", "eval"):
        check_tools(cfg, with_files=True)
    check_data(cfg, command)
