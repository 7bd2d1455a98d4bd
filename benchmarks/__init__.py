"""Benchmarks for corp-deploy: what ``corp-deploy bench`` and ``corp-deploy sweep`` run.

``targets`` (artifact and export to models), ``data`` (held-out images, labelled ImageFolder),
``backends`` (which backends run), ``latency`` (interleaved timing), ``fidelity`` (compressed vs
dense), ``harness`` (one report), ``results`` (the report, typed), ``gate`` (regression gate),
``report`` (Markdown, plot, terminal), ``sweep`` (methods x sparsities).

The measurements behind ``lab/RESULTS.md`` (the studies, the photo set) are in the lab beside the
tool (``lab/``), run from a checkout; not part of the tool, not installed, never imported here.
"""
