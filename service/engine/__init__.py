"""The engine: model versions, dynamic batching and onnxruntime. Imports no web framework."""
