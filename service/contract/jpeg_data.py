"""Whether a JPEG's compressed data can hold the image its header declares.

libjpeg decodes a JPEG whose data ends early (a file cut and ended with an EOI marker, or a header
patched to claim 4000 x 4000 over a 28 x 28 image's data) without an error: it warns, fills the missing
blocks with grey, and Pillow ignores the warning (``LOAD_TRUNCATED_IMAGES`` or not). So the service
checks the file itself, before decoding: every 8 x 8 block of every component has a DC coefficient,
coded with a Huffman code of at least one bit in each Huffman-coded DCT JPEG (baseline, extended or
progressive), so data of fewer bits than the image has blocks cannot be the whole image. A cut that
leaves at least a bit a block is not caught here; it decodes with grey blocks, as in any viewer.
"""

from __future__ import annotations

import math
import re

# SOF markers of Huffman-coded DCT frames (baseline, extended, progressive): the ones checked
_HUFFMAN_DCT_FRAMES = {0xC0, 0xC1, 0xC2}
# every other start of frame (lossless, hierarchical, arithmetic-coded): not checked
_OTHER_FRAMES = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_SOS, _EOI = 0xDA, 0xD9
# where a scan's entropy-coded data ends: a marker that is neither a stuffed 0x00 nor a restart
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def blocks_and_data(data: bytes) -> tuple[int, int, int, int] | None:
    """``(width, height, blocks, data_bits)`` of a Huffman-coded DCT JPEG: its header's size, the
    8 x 8 blocks of all its components, and the bits of its scans' entropy-coded data. None when it
    is not such a JPEG or its markers cannot be followed (its decoder then judges it)."""
    frame: tuple[int, int, int] | None = None
    bits = 0
    at, size = 2, len(data)  # past SOI
    while at + 4 <= size:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte before a marker
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            at += 2
            continue
        if marker == _EOI:
            break
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        if length < 2:
            return None
        segment = data[at + 4 : at + 2 + length]
        if marker in _OTHER_FRAMES:
            return None
        if marker in _HUFFMAN_DCT_FRAMES:
            frame = _frame_blocks(segment)
            if frame is None:
                return None
        at += 2 + length
        if marker == _SOS:
            end = _SCAN_END.search(data, at)
            stop = size if end is None else end.start()
            bits += 8 * (stop - at)
            at = stop
    if frame is None:
        return None
    return (*frame, bits)


def _frame_blocks(segment: bytes) -> tuple[int, int, int] | None:
    """A frame header's width, height and 8 x 8 blocks over its components."""
    if len(segment) < 6:
        return None
    height = int.from_bytes(segment[1:3], "big")
    width = int.from_bytes(segment[3:5], "big")
    count = segment[5]
    if len(segment) < 6 + 3 * count or not count or not height:  # height 0: set by a DNL marker
        return None
    sampling = [(segment[7 + 3 * i] >> 4, segment[7 + 3 * i] & 15) for i in range(count)]
    if any(h == 0 or v == 0 for h, v in sampling):
        return None
    h_max = max(h for h, _ in sampling)
    v_max = max(v for _, v in sampling)
    blocks = sum(
        math.ceil(math.ceil(width * h / h_max) / 8) * math.ceil(math.ceil(height * v / v_max) / 8)
        for h, v in sampling
    )
    return width, height, blocks


def truncation(data: bytes) -> str | None:
    """Why a JPEG's data cannot hold its image (it is truncated), or None."""
    found = blocks_and_data(data)
    if found is None:
        return None
    width, height, blocks, bits = found
    if bits >= blocks:
        return None
    return (
        f"the JPEG image is truncated: its header says {width}x{height} pixels ({blocks} blocks "
        f"of 8x8), and its data of {bits // 8} bytes cannot hold more than {bits} of them"
    )
