"""ONNX (and, later, TensorRT) exporters for corp-deploy artifacts.

Done so far (export issue, first step): ``onnx_export.export_onnx`` and
``parity.compare_outputs`` / ``parity.onnxruntime_outputs``. Not yet: the
``corp-deploy export`` command, fp16, TensorRT engines, ``build_engine.sh``, the manifest.
"""
