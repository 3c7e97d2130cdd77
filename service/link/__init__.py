"""The process link: how a front end reaches the engine process, and what they say to each other.

``client.EngineClient`` is what a front end calls as if the engine were local; ``remote.RemoteEngine``
reaches the engine process over a Unix socket (``wire``) with the rows in shared memory (``arena``), in
the messages of ``protocol``. The link imports nothing of the engine: the engine's end of the socket is
``service/engine/server.py``, and the engine in a front end's own process ``service/engine/local.py``.
"""
