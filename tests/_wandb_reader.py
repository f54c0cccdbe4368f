"""Read the records of a W&B offline run file (`run-<id>.wandb`) with wandb's own record type
(wandb.proto.wandb_internal_pb2.Record). wandb 0.31 reads these files in its Go core only (its
Python DataStore is gone), so the framing is read here: a 7-byte header (":W&B", magic 0xBEE1,
version 0), then LevelDB-log records in 32 KiB blocks, each chunk with a 7-byte header (crc32,
length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a header is
padding."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<IHB")
FILE_HEADER = struct.Struct("<4sHB")


def records(path: Path) -> list[Any]:
    """Every Record in the file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = FILE_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, parts, found = FILE_HEADER.size, b"", []
    while pos + HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < HEADER.size:  # padding at the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        chunk = data[pos + HEADER.size : pos + HEADER.size + length]
        pos += HEADER.size + length
        if kind == 0 and length == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            found.append(record)
    return found


def _items(items: Any) -> dict[str, Any]:
    """{key: value} of a record's items (a key is `key`, or `nested_key` joined by '.')."""
    return {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in items}


def run_data(path: Path) -> dict[str, Any]:
    """The run's config, its last summary, and its history rows (step -> {key: value})."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: dict[int, dict[str, Any]] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update(_items(record.run.config.update))
        elif kind == "config":
            config.update(_items(record.config.update))
        elif kind == "summary":
            summary.update(_items(record.summary.update))
        elif kind == "history":
            row = _items(record.history.item)
            history[int(row["_step"])] = row
    return {"config": config, "summary": summary, "history": history}
