"""Benchmarks for corp-deploy: what ``corp-deploy bench`` and ``corp-deploy sweep`` run.

``targets`` (artifact and export to models), ``data`` (held-out images, labelled ImageFolder),
``backends`` (which backends run), ``latency`` (interleaved timing), ``fidelity`` (compressed vs
dense), ``harness`` (one report), ``results`` (the report, typed), ``gate`` (regression gate),
``report`` (Markdown, plot, terminal), ``sweep`` (methods x sparsities).

The one-off measurement scripts behind ``RESULTS.md`` are in :mod:`benchmarks.studies`; they
are not part of the product (and not installed with it).
"""
