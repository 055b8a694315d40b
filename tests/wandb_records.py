"""Reading an offline W&B run back in tests: its ``run-<id>.wandb`` file is a LevelDB-style
log (W&B's 7-byte header, then 32 KiB blocks of chunks with a 7-byte chunk header) of
protobuf ``Record`` messages, which ``wandb.proto`` defines."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, offset = [], b"", 7
    while offset + CHUNK_HEADER <= len(data):
        left = BLOCK - offset % BLOCK
        if left < CHUNK_HEADER:  # the block's tail is padding
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + CHUNK_HEADER])
        chunk = data[offset + CHUNK_HEADER:offset + CHUNK_HEADER + length]
        offset += CHUNK_HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(records: list) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
