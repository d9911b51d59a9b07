"""The online side: runs exported artifacts. Its ONNX Runtime path imports no torch."""
