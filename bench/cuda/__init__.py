"""``python -m bench.cuda``: the service on an NVIDIA GPU, checked against the CPU, then measured.

Run it on a machine with a CUDA GPU, onnxruntime-gpu (requirements/serve-gpu.txt) and hey:

    python -m bench.cuda --output cuda.md [--hey-threads 4] [--seconds 5]

1. Each model file on onnxruntime's CUDA provider against its CPU provider, on the Fashion-MNIST test
   images (synthetic garments when the dataset is missing): relative error of the outputs, top-1
   agreement and accuracy; then milliseconds per batch on each provider.
2. ``python -m service`` with ``VITSERVE_PROVIDER=cuda``: it reports the CUDA provider, and /predict,
   /v2 infer and /attention answer what the CPU provider computes for the same images.
3. Load: hey at each concurrency against vitserve on CUDA (``VITSERVE_WORKERS`` 1, 4 and the cores),
   vitserve on the CPU (the cores) and the plain server (onnxruntime on the CPU, batch 1), one server
   at a time, with the cores each one's processes used.

Prints the report (Markdown) and exits 1 when a check of parts 1-2 fails. hey runs with
``GOMAXPROCS=--hey-threads``: on a many-core machine one thread would be the bottleneck.
"""
