"""ONNX and TensorRT exporters for corp-deploy artifacts (see the export issue; not implemented yet)."""
