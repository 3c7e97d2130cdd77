"""The framing of the link between front ends and the engine: one Unix socket per front end.

A message carries every item one side had ready in one turn of its event loop (:class:`Outbox`): a
prefix of two lengths, the msgpack list of the items (each a typed struct of ``protocol``, with its raw
frames' lengths), then the items' raw frames for tensors (never encoded). The codec is here: the
structs' encoder and each side's decoder (``to_engine``, ``to_front_end``), a control call's value
(:func:`result_value`), and an answer's outputs as raw frames (:func:`answer_frames`,
:func:`answer_outputs`). One message for many items
matters: under load each write and each wake-up of the other side, not the copy, is the link's cost.

Whatever arrives is checked before it is used: a prefix claiming more than the link's ``max_bytes`` is
refused before anything is allocated for it, and a message whose items do not decode as the protocol's
structs, or whose frames do not add up, is refused whole. Either way the link it came on is closed
(:class:`~service.link.protocol.LinkViolation`); the other links, and what they carry, go on.

The sockets are asyncio's own Unix-socket transports (:class:`Link`): no I/O thread between a message
and its reader (docs/decisions.md#link-without-zeromq).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
from pydantic import BaseModel

from service.contract import control
from service.contract.table import Outputs
from service.link.protocol import Answer, LinkViolation, ToEngine, ToFrontEnd

logger = logging.getLogger("vitserve")

# a message's first bytes: its items' length, then its raw frames' length
_PREFIX = struct.Struct("<QQ")
# the largest message a link takes: far above a request's rows (max_body_bytes decoded), far below
# what would hurt the process reading it
MAX_MESSAGE_BYTES = 256 * 2**20

# a reader that does not read (the engine's answers to a front end that never reads them): past
# UNREAD_PAUSE_BYTES unsent, the link stops reading that side's calls until they drain; past
# UNREAD_MAX_BYTES (a burst of calls read before the pause), it is closed
UNREAD_PAUSE_BYTES = 4 * 2**20
UNREAD_MAX_BYTES = 64 * 2**20

Item = tuple[Any, list]  # a protocol struct and its raw frames
OnMessage = Callable[["Link", list[Item]], None]


@dataclass(frozen=True)
class Addresses:
    """Where the engine listens: a Unix socket in the supervisor's private run directory."""

    engine: str

    @classmethod
    def in_directory(cls, directory: str) -> Addresses:
        return cls(os.path.join(directory, "engine"))


# A Unix socket's address holds 107 bytes and a NUL.
SOCKET_PATH_MAX = 107


@contextlib.contextmanager
def socket_path(path: str) -> Iterator[str]:
    """``path`` to bind or connect to; when it is longer than a socket's address can hold (a deep
    TMPDIR), the same file reached through a descriptor of its directory, ``/proc/self/fd/N/name``,
    open for the call only: the directory's permissions still guard it."""
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX:
        yield path
        return
    directory, name = os.path.split(path)
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{descriptor}/{name}"
    finally:
        os.close(descriptor)


# --- the items: msgpack (msgspec) for the structs, raw frames for an answer's outputs ----------


def _encode_hook(value: Any) -> Any:
    if isinstance(value, BaseModel):  # a version's metadata
        return value.model_dump(mode="json")
    raise NotImplementedError(f"{type(value).__name__} cannot travel on the link")


def _decode_hook(kind: type, value: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind.model_validate(value)
    raise NotImplementedError(f"{kind} cannot travel on the link")


encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
# a message's items: each with its raw frames' lengths
FrameLengths = list[Annotated[int, msgspec.Meta(ge=0)]]
to_engine = msgspec.msgpack.Decoder(list[tuple[ToEngine, FrameLengths]], dec_hook=_decode_hook)
to_front_end = msgspec.msgpack.Decoder(list[tuple[ToFrontEnd, FrameLengths]], dec_hook=_decode_hook)


def result_value(op: str, raw: msgspec.Raw) -> Any:
    """A control call's value, checked against its operation's type (service/contract/control.py)."""
    return msgspec.msgpack.decode(raw, type=control.OPERATIONS[op].answers)


# each output dtype's text, for the few dtypes models answer in (``dtype.str`` formats a new string
# at every call, with libc's printf)
_DTYPE_TEXT: dict[np.dtype, str] = {}


def answer_frames(call: int, outputs: Outputs) -> tuple[Answer, list]:
    """The answer to ``call`` and its outputs' raw bytes (a request's rows of a batch's outputs are
    contiguous already: no copy)."""
    shapes, frames = [], []
    for output in outputs:
        frame = np.ascontiguousarray(output)
        dtype = frame.dtype
        text = _DTYPE_TEXT.get(dtype)
        if text is None:
            text = _DTYPE_TEXT[dtype] = dtype.str
        shapes.append((text, frame.shape))
        frames.append(frame)
    return Answer(call, shapes), frames


def answer_outputs(answer: Answer, frames: list) -> Outputs:
    """An answer's outputs; a frame whose length does not match its shape is a violation."""
    try:
        return [
            np.frombuffer(frame, dtype=np.dtype(dtype)).reshape(shape)
            for (dtype, shape), frame in zip(answer.outputs, frames, strict=True)
        ]
    except (TypeError, ValueError) as error:
        raise LinkViolation(f"answer {answer.call}: {error}") from None


# --- messages ---------------------------------------------------------------------------------------


def pack(items: list[Item]) -> bytes:
    """Items ``(struct, raw frames)`` as one message, to be written in one go (one wake-up of the
    reader: docs/decisions.md#link-without-zeromq)."""
    headers, raw, raw_bytes = [], [], 0
    for message, frames in items:
        if not frames:
            headers.append((message, ()))
            continue
        lengths = []
        for frame in frames:  # any C-contiguous buffer: bytes, a memoryview, an array
            view = memoryview(frame)
            lengths.append(view.nbytes)
            raw.append(view)
        raw_bytes += sum(lengths)
        headers.append((message, lengths))
    packed = encoder.encode(headers)
    return b"".join([_PREFIX.pack(len(packed), raw_bytes), packed, *raw])


def unpack(message: memoryview, decoder: msgspec.msgpack.Decoder) -> list[Item]:
    """The items of one whole message (prefix included), in order, each with its raw frames as views
    of ``message``; :class:`LinkViolation` when it breaks the protocol."""
    header_bytes, raw_bytes = _PREFIX.unpack_from(message)
    at = _PREFIX.size + header_bytes
    try:
        headers = decoder.decode(message[_PREFIX.size : at])
    except (msgspec.DecodeError, NotImplementedError, ValueError) as error:
        raise LinkViolation(f"a message that is not the protocol's: {error}") from None
    if not raw_bytes and not any(lengths for _, lengths in headers):  # rows in the arena
        return [(header, []) for header, _ in headers]
    if sum(length for _, lengths in headers for length in lengths) != raw_bytes:
        raise LinkViolation("a message whose frames do not add up to its length")
    items = []
    for header, lengths in headers:
        raw = []
        for length in lengths:
            raw.append(message[at : at + length])
            at += length
        items.append((header, raw))
    return items


def split(data: memoryview, max_bytes: int) -> tuple[list[memoryview], int]:
    """The whole messages at the start of ``data``, and how many of its bytes they take;
    :class:`LinkViolation` for a prefix that claims more than ``max_bytes``."""
    messages, at = [], 0
    while len(data) - at >= _PREFIX.size:
        header_bytes, raw_bytes = _PREFIX.unpack_from(data, at)
        if header_bytes + raw_bytes > max_bytes:
            raise LinkViolation(
                f"a message of {header_bytes + raw_bytes} bytes, above the link's {max_bytes}"
            )
        end = at + _PREFIX.size + header_bytes + raw_bytes
        if end > len(data):
            break
        messages.append(data[at:end])
        at = end
    return messages, at


class Link(asyncio.Protocol):
    """One end of a front end's connection to the engine: each message that arrives, decoded with
    ``decoder``, goes to ``on_message(link, items)`` in order; ``outbox`` sends. A message that breaks
    the protocol, or an ``on_message`` that raises :class:`LinkViolation`, closes the link.
    ``on_lost(link)`` runs once, when the connection has ended (either side closed it, or died).

    ``bound_unread``: what this side sends and the other leaves unread is bounded (the engine's side:
    a front end that never reads its answers must not hold the engine's memory). Past
    ``UNREAD_PAUSE_BYTES`` waiting to be sent, the other side's messages are not read until they
    drain (asyncio's ``pause_writing``); past ``UNREAD_MAX_BYTES`` the link is closed. Never both
    sides: each would wait for the other to read."""

    def __init__(
        self,
        decoder: msgspec.msgpack.Decoder,
        on_message: OnMessage,
        on_lost: Callable[[Link], None] | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        unsendable: Unsendable | None = None,
        bound_unread: bool = False,
    ) -> None:
        self._decoder = decoder
        self._on_message = on_message
        self._on_lost = on_lost
        self._max_bytes = max_bytes
        self._partial = bytearray()  # the start of a message still arriving
        self.transport: Any = None  # an asyncio.Transport (uvloop's are not its subclasses)
        self.outbox = Outbox(self._write, unsendable)
        self._bound_unread = bound_unread
        self.reading_paused = False  # the other side's messages wait: ours to it are unread
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def closing(self) -> bool:
        """Closed, or closing (refused): what it still brings will not be answered."""
        return self.transport is not None and self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self._bound_unread:
            transport.set_write_buffer_limits(high=UNREAD_PAUSE_BYTES)  # type: ignore[attr-defined]

    def pause_writing(self) -> None:
        """What we sent waits unread past the high-water mark: read nothing more from the other side
        (its calls would only add answers) until it drains."""
        if self._bound_unread and self.open:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            if self.open:
                self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self._on_lost is not None:
            self._on_lost(self)

    def close(self) -> None:
        self.outbox.flush()
        if self.transport is not None:
            self.transport.close()

    def refuse(self, violation: LinkViolation) -> None:
        """The other side broke the protocol: say so and drop the connection, unread data too."""
        logger.error("the link to another process broke the protocol and is closed: %s", violation)
        self._partial = bytearray()
        self._on_message = _ignore
        if self.transport is not None:
            self.transport.abort()

    def _write(self, message: bytes) -> None:
        if not self.open:
            return
        if self._bound_unread:
            unsent = self.transport.get_write_buffer_size() + len(message)
            if (
                unsent > UNREAD_MAX_BYTES
            ):  # closed, rather than held for a reader that does not read
                self.refuse(
                    LinkViolation(
                        f"the other side leaves what it is sent unread: {unsent} bytes would "
                        f"wait, above the link's {UNREAD_MAX_BYTES}"
                    )
                )
                return
        self.transport.write(message)

    def data_received(self, data: bytes) -> None:
        try:
            if self._partial:  # the rest of a message: whole ones are copied out of the buffer
                self._partial += data
                with memoryview(self._partial) as view:
                    messages, used = split(view, self._max_bytes)
                    messages = [memoryview(bytes(message)) for message in messages]
                del self._partial[:used]
            else:  # the usual case: whole messages, read in place
                messages, used = split(memoryview(data), self._max_bytes)
                if used < len(data):
                    self._partial += data[used:]
            for message in messages:
                items = unpack(message, self._decoder)
                try:
                    self._on_message(self, items)
                except LinkViolation:
                    raise
                except Exception:  # a fault of this side must not stop the link
                    logger.exception("a message from the other process could not be handled")
        except LinkViolation as violation:
            self.refuse(violation)


def _ignore(link: Link, items: list[Item]) -> None:
    """What a refused link does with what still arrives before it is gone."""


# what a side does with an item that cannot be encoded (a number beyond msgpack's 64 bits): the item
# to send instead (its call's refusal), or None (its caller has been answered here)
Unsendable = Callable[[Any, Exception], Item | None]


class Outbox:
    """Items to send on a link, sent together once the event loop has run what is ready; an item put
    ``at_once`` (a lone call, or its answer: nothing else in flight) goes now when nothing waits before
    it, since no partner will join it this turn (docs/decisions.md#outbox-at-once).

    An item that cannot be encoded is refused on its own: ``unsendable(item, error)`` answers its
    caller (or names the item to send instead), and the other items of the message still go."""

    def __init__(self, send: Callable[[bytes], None], unsendable: Unsendable | None = None) -> None:
        self._send = send
        self._unsendable = unsendable
        self._items: list[Item] = []

    def put(self, message: Any, *raw: Any, at_once: bool = False) -> None:
        first = not self._items  # else a flush is due this turn, and this item goes with it
        self._items.append((message, list(raw)))
        if first and at_once:
            self.flush()
        elif first:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        items, self._items = self._items, []
        if not items:
            return
        try:
            message = pack(items)
        except Exception:  # one item that cannot be encoded: find it, and send the others
            items = self._encodable(items)
            if not items:
                return
            message = pack(items)
        try:
            self._send(message)
        except Exception as error:
            logger.error("a message to the other process was not sent: %r", error)

    def _encodable(self, items: list[Item]) -> list[Item]:
        """``items`` less those that cannot be encoded, each refused on its own (replaced by what
        ``unsendable`` gives, when that can be encoded)."""
        kept = []
        for item in items:
            try:
                encoder.encode(item[0])
            except Exception as error:
                logger.error(
                    "a %s to the other process cannot be encoded and is refused: %r",
                    type(item[0]).__name__,
                    error,
                )
                instead = None if self._unsendable is None else self._unsendable(item[0], error)
                if instead is None:
                    continue
                try:
                    encoder.encode(instead[0])
                except Exception:
                    continue
                item = instead
            kept.append(item)
        return kept
