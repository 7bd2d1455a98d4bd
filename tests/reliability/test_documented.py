"""docs/reliability.md lists every case of this suite: each row of a table names one, and every
case (a test, or an entry of the REFUSALS and FAULTS tables that one test runs) has its row."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

SUITE = Path(__file__).resolve().parent
DOC = SUITE.parents[1] / "docs" / "reliability.md"

#: The tests that run a table's entries, each entry a case of its own.
TABLE_RUNNERS = {
    "test_refused_with_one_message_and_nothing_changed",
    "test_an_interrupted_run_leaves_the_previous_output_intact_and_no_debris",
}


def _cases() -> set[str]:
    """Every case of every module of the suite but this one, as docs/reliability.md names it: a
    test's name without ``test_``, dashed, and each key of a module's ``REFUSALS`` or ``FAULTS``."""
    cases = set()
    for module in pkgutil.iter_modules([str(SUITE)]):
        if module.name.startswith("test_") and module.name != "test_documented":
            found = vars(importlib.import_module(f"{__package__}.{module.name}"))  # as pytest imported it
            tests = [name for name in found if name.startswith("test_") and name not in TABLE_RUNNERS]
            cases |= {name[len("test_") :].replace("_", "-") for name in tests}
            cases |= set(found.get("REFUSALS", ())) | set(found.get("FAULTS", ()))
    return cases


def test_docs_list_every_case():
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), flags=re.M))
    cases = _cases()
    assert documented == cases, (sorted(cases - documented), sorted(documented - cases))
