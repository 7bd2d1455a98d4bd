"""The ``corp-deploy`` command line: a thin layer over the library, one module per command.

:mod:`.group` holds the command group (exit statuses, every failure as one message),
:mod:`.options` the option groups and types the commands share, :mod:`.common` what they share
besides (warnings, input folders, the dense model). Commands: :mod:`.compress`, :mod:`.export`,
:mod:`.bench`, :mod:`.sweep`, :mod:`.recover`; each registers itself on the group when imported here.
"""

from . import bench, compress, export, recover, sweep  # noqa: F401  (registers the commands)
from .group import EXIT_CODES, cli

__all__ = ["EXIT_CODES", "cli"]
