"""``setting()``: a dataclass field that carries its numeric bounds and one line of help.

Every component that reads a section of the experiment config defines that section's dataclass itself,
with its defaults, in its own package (the tools' sections in :mod:`megatron_arpo.tools.config`, ...);
:mod:`megatron_arpo.config_schema` composes them into the experiment config, and
:mod:`megatron_arpo.config` checks the bounds and renders the config reference from the help. This module
is the one thing they share, so that components do not import the experiment config.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, ge: float | None = None,
            gt: float | None = None, le: float | None = None, lt: float | None = None, help: str = "") -> Any:
    """A dataclass field carrying its numeric bounds and one line of help for the config reference."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "help": help}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
