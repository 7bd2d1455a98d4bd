"""Benchmarks for corp-deploy: the ``bench`` and ``sweep`` harness and measurement scripts.

Harness (what ``corp-deploy bench`` / ``sweep`` run): ``targets`` (artifact and export to
models), ``data`` (held-out images, labelled ImageFolder), ``backends`` (which backends run),
``latency`` (interleaved timing), ``fidelity`` (compressed vs dense), ``harness`` (one report),
``gate`` (regression gate), ``report`` (Markdown, plot, terminal), ``sweep`` (methods x sparsities).

Scripts (``python -m benchmarks.<name>``, results in RESULTS.md): ``compress_cost``,
``dinov2_fidelity``, ``export_choice``, ``toast_selection``; ``real_weights`` provides the
real DINOv2 ViT-S/14.
"""
