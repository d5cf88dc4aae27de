"""Every `megatron-arpo` subcommand speaks the same language: its usage line says `megatron-arpo ...`, every
option has help text that states its default, one name per concept (old names still work, with a warning),
and one error prefix.

The parsers are the real ones: each command function is called and its parser captured at
``parse_args``, then walked through every level of subcommands.
"""

from __future__ import annotations

import argparse
import importlib

import pytest

from megatron_arpo import cli


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(command: cli.Command, monkeypatch) -> argparse.ArgumentParser:
    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        try:
            getattr(importlib.import_module(command.module), command.function)([])
        except _Captured as got:
            return got.parser
    raise AssertionError(f"{command.name}: no argparse parser was used")


def _walk(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _walk(sub)


def _all_parsers(monkeypatch):
    for command in cli.COMMANDS:
        for parser in _walk(_parser_of(command, monkeypatch)):
            yield command.name, parser


NO_DEFAULT = (None, False, argparse.SUPPRESS, [])


def test_every_option_of_every_subcommand_has_help_with_its_default(monkeypatch):
    problems = []
    for name, parser in _all_parsers(monkeypatch):
        if not parser.prog.startswith(f"megatron-arpo {name}"):
            problems.append(f"{parser.prog}: usage line does not say `megatron-arpo {name} ...`")
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            shown = "/".join(action.option_strings) or action.dest
            if action.help is argparse.SUPPRESS and not action.option_strings:
                continue  # the main parser's pass-through of a command's arguments
            if not action.help:
                problems.append(f"{parser.prog} {shown}: no help text")
                continue
            if action.option_strings and action.default not in NO_DEFAULT and not action.required \
                    and "default" not in action.help and "deprecated" not in action.help:
                problems.append(f"{parser.prog} {shown}: help does not state the default {action.default!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("argv, old, new", [
    (["plan", "--model", "qwq-32b", "--tp", "3"], "--model", "--model-config"),
    (["eval", "--model", "/nonexistent/ckpt", "--datasets", "aime24", "--data-dir", "/nonexistent"], "--model", "--hf"),
])
def test_old_option_names_still_work_with_a_warning(argv, old, new, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"warning: {old} is deprecated; use {new}" in err
    assert f"megatron-arpo {argv[0]}: error: " in err  # it was parsed and acted on


def test_one_plan_the_others_point_at_it(capsys):
    assert cli.main(["launch", "plan", "--model-config", "qwq-32b", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "deprecated; use `megatron-arpo plan`" in err
    assert "megatron-arpo launch plan: error: actor.tensor_parallel: 3 does not divide" in err


@pytest.mark.parametrize("argv, prefix", [
    (["config", "validate", "--config", "/nonexistent.yaml"], "megatron-arpo config: error: "),
    (["plan", "--model-config", "no-such-model"], "megatron-arpo plan: error: "),
    (["launch", "slurm", "--config", "/nonexistent.yaml", "--dry-run"], "megatron-arpo launch slurm: error: "),
    (["convert", "shapes", "--model-config", "qwq-32b", "--tp", "16", "--pp", "1"], "megatron-arpo convert shapes: error: "),
    (["eval", "--hf", "/nonexistent/ckpt", "--datasets", "aime24", "--data-dir", "/x"], "megatron-arpo eval: error: "),
])
def test_one_error_prefix(argv, prefix, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(prefix), err
