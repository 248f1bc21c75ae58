"""gpudecode: beam-search decoding of ONNX sequence models with decoder states on the GPU."""

__version__ = "0.1.0"
