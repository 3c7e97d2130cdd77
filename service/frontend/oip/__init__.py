"""The Open Inference Protocol (KServe v2) over HTTP/REST, on the same pipelines as ``/predict``."""
