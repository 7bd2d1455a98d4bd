"""The compression methods, one module each, and their registry.

A method (:class:`Method`) declares what it prunes, the settings only it reads, and how it
compresses the blocks; ``CompressConfig``, the engine, the CLI and ``sweep`` all read it from
:data:`METHODS`, so a new method is one module plus one line here.
"""
from __future__ import annotations

from .base import BlockRun, Method
from .corp import Corp
from .toast import Toast
from .vbp import Vbp

#: Every method by name, in the order ``--help`` and ``sweep`` list them.
METHODS: dict[str, Method] = {method.name: method for method in (Corp(), Vbp(), Toast())}


def option_owners() -> dict[str, str]:
    """``{CompressConfig field: method name}`` for the settings that only one method reads."""
    return {option: method.name for method in METHODS.values() for option in method.options}


__all__ = ["METHODS", "BlockRun", "Method", "option_owners"]
