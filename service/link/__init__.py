"""The process link: how a front end reaches the engine, in its own process or in another one.

``client.EngineClient`` is what a front end calls as if the engine were local; ``client.LocalEngine`` runs
the engine in the front end's process (tests, the smallest deployments), ``remote.RemoteEngine`` reaches an
engine process over a Unix socket (``wire``) with the rows in shared memory (``arena``), served there by
``engine_server``.
"""
