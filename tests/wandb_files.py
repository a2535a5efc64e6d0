"""Read W&B's local run files (offline runs) without the network: the ``.wandb`` record
log (LevelDB log format: 32 KiB blocks, 7-byte record headers, FULL/FIRST/MIDDLE/LAST
fragments) parsed as ``wandb_internal_pb2.Record``."""

from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32768
HEADER = 7  # checksum u32, length u16, type u8
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path}: not a W&B record file"
    pos, pending = 7, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left  # zero padding to the end of the block
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            pending = body
        elif kind == FIRST:
            pending = body
            continue
        elif kind == MIDDLE:
            pending += body
            continue
        elif kind == LAST:
            pending += body
        else:
            raise ValueError(f"{path}: record type {kind} at {pos}")
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        yield record


def run_dirs(root: str) -> list:
    """``<root>/wandb/offline-run-*-<id>`` (and online ``run-*``) directories, oldest first."""
    return sorted(glob.glob(os.path.join(root, "wandb", "*run-*")))


def read_run(run_dir: str) -> dict:
    """{"id", "name", "group", "job_type", "tags", "config": {key: value},
    "history": [{key: value}], "files": [...]}"""
    path = glob.glob(os.path.join(run_dir, "run-*.wandb"))[0]
    out = {"id": None, "config": {}, "history": [], "files": []}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out.update(name=record.run.display_name, group=record.run.run_group,
                       job_type=record.run.job_type, tags=list(record.run.tags))
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
    for root, _, files in os.walk(os.path.join(run_dir, "files")):
        out["files"] += [os.path.relpath(os.path.join(root, f), run_dir) for f in files]
    return out
