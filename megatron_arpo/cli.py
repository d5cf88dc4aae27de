"""The ``megatron-arpo`` command line.

Subcommands live in a table of (name, module, function): the module is imported only when its command
runs, so ``megatron-arpo config show`` never imports torch, vLLM, Megatron or Ray. A command function
takes its own argv (everything after the command name) and returns an exit code; it builds its own
argparse parser with ``prog=f"megatron-arpo {name}"`` and can use ``add_config_arguments`` /
``config_from_args`` for the shared ``--config X --set a.b=c`` options.

To add a command, append a ``Command`` to ``COMMANDS`` once its module exists. An ``InputError``
(``megatron_arpo.errors``: ``ConfigError``, a bad dataset or SFT row, a broken checkpoint to resume from)
raised by any command becomes a one-line message on stderr and exit code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import yaml

from megatron_arpo import __version__
from megatron_arpo.command_args import PROG, add_config_arguments, config_from_args
from megatron_arpo.config import config_warnings, describe_fields
from megatron_arpo.errors import InputError, as_symlink_loop
from megatron_arpo.device.quiet import quiet_cpu_warnings

EXIT_CONFIG_ERROR = 2


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    function: str
    help: str


# Only commands whose modules exist are listed here.
COMMANDS: tuple[Command, ...] = (
    Command("config", "megatron_arpo.cli", "config_main", "show or validate an experiment config"),
    Command("train", "megatron_arpo.train", "train_main", "ARPO/AEPO RL training: rollout, reward, update, sync, save"),
    Command("sft", "megatron_arpo.sft", "sft_main", "cold-start SFT on ShareGPT tool-use conversations"),
    Command("eval", "evaluation.cli", "main", "evaluate a checkpoint: pass@k, metrics, LLM judge"),
    Command("convert", "conversion.__main__", "main", "HF <-> Megatron checkpoints: hf-to-megatron, megatron-to-hf, verify, shapes"),
    Command("launch", "launchers.cli", "launch_main", "launch a job: slurm (sbatch, multi-node) or local (Ray on this host)"),
    Command("plan", "launchers.cli", "plan_main", "per-GPU memory plan: does this config fit?"),
    Command("demo", "megatron_arpo.demo", "demo_main", "the end-to-end CPU demo: SFT, ARPO, evaluation"),
    Command("doctor", "megatron_arpo.doctor", "doctor_main", "check a GPU node's stack: torch/CUDA, NCCL, TE, vLLM, sandbox, run dir"),
    Command("plot", "megatron_arpo.plot", "plot_main", "PNG learning curves of a run from its metrics.jsonl"),
)


def config_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} config", description="Show or validate an experiment config.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="{show,validate,reference}")
    show = sub.add_parser("show", help="print the resolved config (secrets redacted)")
    add_config_arguments(show)
    show.add_argument("--format", choices=("yaml", "json"), default="yaml", help="output format (default: %(default)s)")
    check = sub.add_parser("validate", help="validate the config and its tools (sandbox, retriever); exit 2 on any "
                                            "problem")
    add_config_arguments(check)
    check.add_argument("--paths", choices=("train", "sft", "eval"), default=None,
                       help="also run everything this command checks before it starts, as `launch` does: its files "
                            "exist, their rows are valid, the checkpoint matches model.config, the tokenizer loads "
                            "(default: the config and the tools only)")
    sub.add_parser("reference", help="print the config reference (every key, type, default) as markdown")
    args = parser.parse_args(list(argv))

    if args.action == "reference":
        print(render_config_reference(), end="")
        return 0
    cfg = config_from_args(args)
    if args.action == "show":
        data = cfg.redacted()
        if args.format == "json":
            print(json.dumps(data, indent=2))
        else:
            print(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), end="")
        return 0
    # deferred: pulls in asyncio, ctypes, urllib, which this module's importers need not load
    from megatron_arpo.preflight import PreflightError, find_problems, tool_problems

    # The checks `launch` runs before it submits: the tools on this machine (sandbox, interpreter, keys, the
    # retriever answering) and, with --paths, the files, their rows, the checkpoint and the tokenizer.
    problems = find_problems(cfg, args.paths) if args.paths else tool_problems(cfg, with_files=False)
    if problems:
        raise PreflightError(problems)
    for warning in config_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{args.config}: OK" + (f" (paths and data checked for {args.paths})" if args.paths else ""))
    return 0


def render_config_reference() -> str:
    """The markdown table of every config key; docs/configuration.md embeds it (a test keeps them equal)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, type_name, default, help_text in describe_fields():
        shown = "" if default is None else json.dumps(default) if not isinstance(default, str) else default
        rows.append(f"| `{key}` | {type_name.replace('|', '/')} | {shown.replace('|', '/')} | {help_text.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def _resolve(command: Command) -> Callable[[Sequence[str]], int]:
    module = importlib.import_module(command.module)
    return getattr(module, command.function)


def _build_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {c.name:<10} {c.help}" for c in COMMANDS)
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Megatron-Core RL training for agentic tool-use models (ARPO / AEPO).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"commands:\n{lines}\n\nRun '{PROG} COMMAND -h' for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("command", metavar="COMMAND", help="one of: " + ", ".join(c.name for c in COMMANDS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    quiet_cpu_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # -h, --version, or a usage error argparse already printed
        return int(exc.code or 0)
    table = {c.name: c for c in COMMANDS}
    command = table.get(ns.command)
    if command is None:
        close = difflib.get_close_matches(ns.command, list(table), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"{PROG}: error: unknown command {ns.command!r}{hint}; commands: {', '.join(table)}", file=sys.stderr)
        return 2
    try:
        return int(_resolve(command)(ns.args) or 0)
    except InputError as exc:  # a config, a dataset row, an SFT file, a checkpoint to resume from, ...
        print(f"{PROG} {command.name}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (OSError, RuntimeError) as exc:  # a symlink loop met while following any path the user gave
        loop = as_symlink_loop(exc)
        if loop is None:
            raise
        print(f"{PROG} {command.name}: error: {loop}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except SystemExit as exc:  # a command's own argparse usage error or -h
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
