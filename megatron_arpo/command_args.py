"""What every ``megatron-arpo`` subcommand shares: the program name and the experiment-config options."""

from __future__ import annotations

import argparse
import sys

from megatron_arpo.config import ExperimentConfig, load_config

PROG = "megatron-arpo"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The shared experiment-config options: ``--config X.yaml`` and repeated ``--set a.b=c``."""
    parser.add_argument("--config", required=True, metavar="YAML", help="experiment config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key, e.g. --set rollout.n=8 (repeatable)")


def config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    return load_config(args.config, args.overrides)


class DeprecatedAlias(argparse.Action):
    """An old option name that still works: stores into the new option's dest and warns once on stderr."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        kwargs["help"] = f"deprecated alias of {new}"
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)
