"""The most each serving setting may be, in config.pbtxt and in the environment alike.

Beyond them a single version could take the machine's memory (docs/decisions.md#serving-setting-maxima);
a config.pbtxt over one is refused with its reason. A module of its own, without protobuf: the settings (and so ``--help``) read it before anything
heavy is imported.
"""

LIMITS = {
    "max_batch_size": 1024,
    "instance_count": 64,
    "max_queue_delay_s": 10.0,
    "max_queue_size": 65536,
    "request_timeout_s": 3600.0,
}
