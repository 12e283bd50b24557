"""Read TensorBoard event files (``events.out.tfevents.*``) without TensorBoard or protobuf.

Megatron-LM with ``--tensorboard-dir DIR`` writes, through ``torch.utils.tensorboard``:
scalars per iteration (``lm loss``, ``grad-norm``, ``batch-size``, ``learning-rate``;
``iteration-time`` in seconds and ``throughput`` in TFLOP/s/GPU with ``--log-timers-to-tensorboard``
(+ ``--log-throughput``); ``mem-max-allocated-bytes`` and friends with
``--log-memory-to-tensorboard``; ``world-size`` with ``--log-world-size-to-tensorboard``) and every
argument once as a text summary (tag ``<arg>/text_summary``, e.g. ``seq_length/text_summary``).

File format (TFRecord): each record is ``uint64 length | uint32 masked_crc32c(length) | data |
uint32 masked_crc32c(data)`` (little endian); ``data`` is a serialized ``tensorflow.Event``:
``wall_time`` (field 1, double), ``step`` (2, int64), ``file_version`` (3, string), ``summary``
(5). ``Summary.value`` (1, repeated) has ``tag`` (1), ``simple_value`` (2, float) or ``tensor``
(8, a ``TensorProto``: ``dtype`` 1, ``float_val`` 5, ``double_val`` 6, ``int_val`` 7,
``string_val`` 8, ``int64_val`` 10, ``tensor_content`` 4). Only what these need is decoded.

``write_events`` writes the same format (scalars as ``simple_value``, texts as string tensors) for
tests and for tools that want to produce comparable files.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import struct
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

# ------------------------------------------------------------------------------------------------
# CRC-32C (Castagnoli), masked as TFRecord does


def _crc32c_table() -> List[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class EventFileError(ValueError):
    """A truncated or corrupt event file."""


def iter_records(path: str, check_crc: bool = True) -> Iterator[bytes]:
    """The data of every record in ``path``. A truncated last record (a writer still running) ends
    the iteration; a CRC mismatch raises ``EventFileError``."""
    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            (length_crc,) = struct.unpack("<I", header[8:])
            if check_crc and masked_crc32c(header[:8]) != length_crc:
                raise EventFileError(f"{path}: bad length checksum at offset {f.tell() - 12}")
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4:
                return
            if check_crc and masked_crc32c(data) != struct.unpack("<I", footer)[0]:
                raise EventFileError(f"{path}: bad data checksum at offset {f.tell() - 4 - length}")
            yield data


# ------------------------------------------------------------------------------------------------
# protobuf wire format (the subset events use)


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise EventFileError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[Tuple[int, int, Union[int, bytes]]]:
    """(field number, wire type, value): varints as int; fixed64/32, length-delimited as bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise EventFileError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _packed(value: Union[int, bytes], wire: int, fmt: str) -> List[float]:
    if wire == 2:  # packed repeated
        size = struct.calcsize(fmt)
        return [struct.unpack(fmt, value[i : i + size])[0] for i in range(0, len(value), size)]
    if wire == 0:
        return [value]
    return [struct.unpack(fmt, value)[0]]


def _packed_varints(value: Union[int, bytes], wire: int) -> List[int]:
    if wire == 0:
        return [_signed64(value)]
    out, pos = [], 0
    while pos < len(value):
        v, pos = _varint(value, pos)
        out.append(_signed64(v))
    return out


_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_STRING, _DT_INT64 = 1, 2, 3, 7, 9


def _tensor_value(buf: bytes):
    """A scalar number or a string from a ``TensorProto`` (None when neither)."""
    dtype, numbers, strings, content = None, [], [], b""
    for number, wire, value in _fields(buf):
        if number == 1:
            dtype = value
        elif number == 4:
            content = value
        elif number == 5:
            numbers += _packed(value, wire, "<f")
        elif number == 6:
            numbers += _packed(value, wire, "<d")
        elif number in (7, 10):
            numbers += _packed_varints(value, wire)
        elif number == 8:
            strings.append(value.decode("utf-8", errors="replace"))
    if strings:
        return strings[0]
    if numbers:
        return float(numbers[0])
    if content:
        fmt = {_DT_FLOAT: "<f", _DT_DOUBLE: "<d", _DT_INT32: "<i", _DT_INT64: "<q"}.get(dtype)
        if fmt and len(content) >= struct.calcsize(fmt):
            return float(struct.unpack(fmt, content[: struct.calcsize(fmt)])[0])
    return None


@dataclasses.dataclass
class Event:
    wall_time: float = 0.0
    step: int = 0
    file_version: Optional[str] = None
    scalars: Dict[str, float] = dataclasses.field(default_factory=dict)
    texts: Dict[str, str] = dataclasses.field(default_factory=dict)


def parse_event(data: bytes) -> Event:
    event = Event()
    for number, wire, value in _fields(data):
        if number == 1 and wire == 1:
            event.wall_time = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event.step = _signed64(value)
        elif number == 3 and wire == 2:
            event.file_version = value.decode("utf-8", errors="replace")
        elif number == 5 and wire == 2:
            for v_number, _, v in _fields(value):
                if v_number == 1:
                    _summary_value(v, event)
    return event


def _summary_value(buf: bytes, event: Event) -> None:
    tag, scalar, tensor = None, None, None
    for number, wire, value in _fields(buf):
        if number == 1:
            tag = value.decode("utf-8", errors="replace")
        elif number == 2 and wire == 5:
            scalar = struct.unpack("<f", value)[0]
        elif number == 8 and wire == 2:
            tensor = _tensor_value(value)
    if tag is None:
        return
    if scalar is not None:
        event.scalars[tag] = scalar
    elif isinstance(tensor, str):
        event.texts[tag] = tensor
    elif tensor is not None:
        event.scalars[tag] = tensor


# ------------------------------------------------------------------------------------------------
# reading runs


def event_files(path: str) -> List[str]:
    """``path`` itself when it is a file, else the event files under the directory ``path``
    (recursively), ordered by name (TensorBoard names them by creation time)."""
    if os.path.isfile(path):
        return [path]
    found = glob.glob(os.path.join(path, "**", "*tfevents*"), recursive=True)
    return sorted(found, key=os.path.basename)


def is_event_path(path: str) -> bool:
    return "tfevents" in os.path.basename(path) or (os.path.isdir(path) and bool(event_files(path)))


@dataclasses.dataclass
class EventRun:
    """Scalars by tag as ``{step: value}`` (a later write of the same step wins: a resumed run
    repeating iterations) and texts by tag (Megatron's arguments: ``texts['seq_length']``)."""

    scalars: Dict[str, Dict[int, float]]
    texts: Dict[str, str]

    def series(self, tag: str) -> List[Tuple[int, float]]:
        return sorted(self.scalars.get(tag, {}).items())


TEXT_SUFFIX = "/text_summary"


def read_run(path: str, check_crc: bool = True) -> EventRun:
    files = event_files(path)
    if not files:
        raise EventFileError(f"{path}: no TensorBoard event files (*tfevents*)")
    scalars: Dict[str, Dict[int, float]] = {}
    texts: Dict[str, str] = {}
    for name in files:
        for data in iter_records(name, check_crc):
            event = parse_event(data)
            for tag, value in event.scalars.items():
                scalars.setdefault(tag, {})[event.step] = value
            for tag, text in event.texts.items():
                key = tag[: -len(TEXT_SUFFIX)] if tag.endswith(TEXT_SUFFIX) else tag
                texts[key] = text
    return EventRun(scalars=scalars, texts=texts)


# ------------------------------------------------------------------------------------------------
# writing (tests, tools)


def _key(number: int, wire: int) -> bytes:
    return _encode_varint((number << 3) | wire)


def _encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _encode_varint(len(payload)) + payload


def encode_event(
    step: int = 0,
    wall_time: float = 0.0,
    scalars: Sequence[Tuple[str, float]] = (),
    texts: Sequence[Tuple[str, str]] = (),
    file_version: Optional[str] = None,
) -> bytes:
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _encode_varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    values = b""
    for tag, value in scalars:
        values += _length_delimited(
            1, _length_delimited(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value)
        )
    for tag, text in texts:
        tensor = _key(1, 0) + _encode_varint(_DT_STRING) + _length_delimited(8, text.encode())
        values += _length_delimited(
            1, _length_delimited(1, (tag + TEXT_SUFFIX).encode()) + _length_delimited(8, tensor)
        )
    if values:
        out += _length_delimited(5, values)
    return out


def encode_record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def write_events(path: str, events: Sequence[bytes]) -> None:
    """Write a TFRecord event file: the ``brain.Event:2`` header record, then ``events``
    (from ``encode_event``)."""
    with open(path, "wb") as f:
        f.write(encode_record(encode_event(file_version="brain.Event:2")))
        for data in events:
            f.write(encode_record(data))
