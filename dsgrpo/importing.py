"""Objects named in configs and on command lines as 'package.module:attribute'."""

from __future__ import annotations

import importlib


def import_object(spec: str, what: str = "reward function"):
    """The attribute `spec` names; a ValueError that says how to write it otherwise."""
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"{what} {spec!r}: write it as 'package.module:function'.")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r} cannot be imported ({exc}).") from None
