"""Measurement scripts behind ``lab/RESULTS.md``, run from a checkout of the repository
(``python -m lab.studies.<name> ...``; each RESULTS.md section gives its command, and each JSON in
``lab/results/`` records the command that wrote it).

``compress_cost`` (compress time against a forward pass), ``dinov2_fidelity`` (held-out fidelity of
methods and settings on real DINOv2 weights), ``export_choice`` (ONNX exporter and opset),
``toast_selection`` (ToaSt's static vs per-input FFN selection), ... They share, with the tests, the
lab's ``real_weights`` and ``held_out`` (:mod:`lab`).
"""
