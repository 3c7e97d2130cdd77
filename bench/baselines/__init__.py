"""The servers vitserve is measured against: what a user would write instead, and the anchors."""

# The anchors' dynamic batching, mosec's and Triton's alike, so that they differ only in their servers.
MAX_BATCH = 64  # most requests per model run
MAX_WAIT_MS = 2  # the longest the first request waits for a batch to fill
