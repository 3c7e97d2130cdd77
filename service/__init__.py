"""vitserve inference service: FastAPI + onnxruntime, never torch."""
