"""The one registry of model families, keyed by the exact Hugging Face ``model_type``.

Every module of this package that defines ``FAMILY`` (a :class:`~megatron_arpo.models.family.ModelFamily`)
is a family; the registry imports them all once, at first use. So adding a family is adding its module
(plus a model YAML and tests): the YAML loader, the HF config checks, the Megatron model builder and the
converters all look families up here. A miss raises ``ValueError`` listing the supported types.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from types import MappingProxyType
from typing import Mapping

import megatron_arpo.models as package
from megatron_arpo.models.family import ModelFamily

_NOT_FAMILIES = ("config", "family", "registry", "rules")  # the machinery, not families


@functools.cache
def families() -> Mapping[str, ModelFamily]:
    found: dict[str, ModelFamily] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, ModelFamily):
            raise TypeError(f"{module.__name__} is in megatron_arpo/models/ but defines no FAMILY = ModelFamily(...)")
        if family.model_type in found:
            raise ValueError(f"model_type {family.model_type!r} is defined twice ({module.__name__} and another module)")
        found[family.model_type] = family
    return MappingProxyType(found)


def get_family(model_type: str) -> ModelFamily:
    try:
        return families()[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported model types: {sorted(families())}"
        ) from None
