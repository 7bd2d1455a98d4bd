"""The compression methods, one module each, and their registry.

A method (:class:`Method`) declares what it prunes, its own validated options
(:class:`MethodOptions`) and how it compresses the blocks; ``CompressConfig``, the engine, the CLI
(its method options are built from the options classes) and ``sweep`` all read it from
:data:`METHODS`, so a new method is one module plus one line here.
"""

from __future__ import annotations

from .base import BlockRun, Method, MethodOptions
from .corp import Corp, CorpOptions
from .toast import Toast, ToastOptions
from .vbp import Vbp, VbpOptions

#: Every method by name, in the order ``--help`` and ``sweep`` list them.
METHODS: dict[str, Method] = {method.name: method for method in (Corp(), Vbp(), Toast())}


def option_owners() -> dict[str, str]:
    """``{option name: method name}`` for every method's options."""
    return {field.name: method.name for method in METHODS.values() for field in method.options_class.fields()}


def option_defaults() -> dict[str, object]:
    """``{option name: default}`` for every method's options, as their fields declare them (a
    default decided later, such as CORP's ranker, is None here)."""
    return {field.name: field.default for method in METHODS.values() for field in method.options_class.fields()}


__all__ = [
    "METHODS",
    "BlockRun",
    "CorpOptions",
    "Method",
    "MethodOptions",
    "ToastOptions",
    "VbpOptions",
    "option_owners",
    "option_defaults",
]
