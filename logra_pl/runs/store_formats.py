"""Every reliance on a logging backend's on-disk format, in one place.

A resumed run must end with each step once in its logger's store (:mod:`logra_pl.runs.stores`). Neither backend
offers all of it through its API, so two things here read or edit their files directly; each says why, and on
which version it was checked (``tests/runs/test_loggers.py`` runs both against the real packages):

- **W&B** keeps an offline run (and, for recovery, an online one) as a *transaction log*: ``run-<id>.wandb`` in a
  ``<offline-run|run>-<time>-<id>`` folder of the ``wandb/`` directory, one folder per ``wandb.init``. wandb 0.31
  ships no Python reader of it (its readers and writers live in the Go ``wandb-core``); a resumed run must know
  which history rows of its earlier segments are still wanted, so :func:`wandb_records` reads the file.
- **MLflow**'s file store (``file:`` tracking URIs) has no API to delete metric points (``MlflowClient`` can delete
  runs, tags and experiments, never history); :func:`drop_mlflow_metric_steps` rewrites the run's metric files.

Format of a ``.wandb`` file (wandb 0.31.0, ``core/pkg/leveldb`` and ``core/internal/transactionlog``): a 7-byte
header (``:W&B``, magic ``0xBEE1`` little-endian, version 0), then LevelDB's log format — 32 KiB blocks of chunks,
each chunk a 7-byte header (CRC-32/IEEE of type byte + payload, little-endian; payload length, uint16; type: 1 full,
2 first, 3 middle, 4 last) and its payload; a block's tail shorter than a header is zero padding. A record is the
concatenated payloads of one full chunk or a first..last run, and is a serialised ``wandb.proto`` ``Record``.
The file is written by wandb-core in blocks and flushed on a timer (``x_transaction_log_flush_interval``, 15 s by
default): a process killed outright loses what had not been flushed, so a file may end in the middle of a record.

Format of MLflow's file store (MLflow 3.17.2, ``mlflow/store/tracking/file_store.py``, stable since MLflow 1.0):
``<root>/<experiment id>/<run id>/metrics/<metric key>`` (a key with ``/`` is nested folders), one line per point:
``<timestamp ms> <value> <step>`` (older lines may lack the step; two extra dataset fields may follow).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKED_WANDB = "0.31.0"
CHECKED_MLFLOW = "3.17.2"

WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


# ---------------------------------------------------------------------------------------------------- W&B
def wandb_records(path: str | Path) -> Iterator[Any]:
    """The ``wandb.proto`` ``Record`` messages of a ``.wandb`` transaction log, in order.

    Stops at the first chunk that is cut short or fails its checksum: what follows was not written completely
    (a killed writer), and W&B's own reader skips it too. Raises ``ValueError`` when the file is not a W&B log.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if not data.startswith(WANDB_HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    pos, parts = len(WANDB_HEADER), []
    while True:
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK_HEADER:  # zero padding at the end of a block
            pos += room
            continue
        if pos + _CHUNK_HEADER > len(data):
            return
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if crc == 0 and length == 0 and kind == 0:  # the rest of the block is padding
            pos += room
            continue
        payload = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        if len(payload) < length or zlib.crc32(bytes([kind]) + payload) != crc:
            return
        pos += _CHUNK_HEADER + length
        if kind in (_FULL, _FIRST):
            parts = [payload]
        elif kind in (_MIDDLE, _LAST) and parts:
            parts.append(payload)
        else:
            parts = []  # a continuation without its start: skip it
            continue
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@dataclass
class WandbSegment:
    """What one ``wandb.init`` of a run wrote: its log file, start time, rewind point and history rows.

    Arguments:
        path: the ``run-<id>.wandb`` file.
        run_id: the run it belongs to.
        start_time: when the segment started (seconds since the epoch); ``wandb sync`` replays a run's segments
            in this order.
        rewind_to: the ``_step`` this segment rewinds the run to (``resume_from="<id>?_step=<k>"``), or None.
        rows: the history rows, each a dict of key → value (``_step`` included).
    """

    path: Path
    run_id: str
    start_time: float
    rewind_to: int | None
    rows: list[dict[str, Any]]


def read_wandb_segment(path: str | Path) -> WandbSegment | None:
    """One ``.wandb`` file as a :class:`WandbSegment`, or None when it holds no run record (nothing was written)."""
    run_id, start, rewind, rows = None, 0.0, None, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run" and run_id is None:
            run_id = record.run.run_id
            start = record.run.start_time.ToMicroseconds() / 1e6
            point = record.run.branch_point
            if point.run == run_id and point.metric == "_step":  # a fork names another run: not a rewind
                rewind = int(point.value)
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            row["_step"] = int(record.history.step.num)
            rows.append(row)
    if run_id is None:
        return None
    return WandbSegment(Path(path), run_id, start, rewind, rows)


def wandb_segments(wandb_dir: str | Path, run_id: str) -> list[WandbSegment]:
    """Every segment of run ``run_id`` under a ``wandb/`` directory (offline and online folders), oldest first."""
    found = []
    for path in sorted(Path(wandb_dir).glob(f"*-{run_id}/run-{run_id}.wandb")):
        segment = read_wandb_segment(path)
        if segment is not None and segment.run_id == run_id:
            found.append(segment)
    return sorted(found, key=lambda s: s.start_time)


def wandb_history(segments: list[WandbSegment]) -> list[dict[str, Any]]:
    """The run's history as ``wandb sync`` leaves it: segments replayed oldest first, each rewind dropping the rows
    after its ``_step`` before the segment's own rows are appended (W&B's ``resume_from``)."""
    rows: list[dict[str, Any]] = []
    for segment in segments:
        if segment.rewind_to is not None:
            rows = [row for row in rows if row["_step"] <= segment.rewind_to]
        rows += segment.rows
    return rows


# ------------------------------------------------------------------------------------------------- MLflow
def mlflow_metric_files(run_dir: str | Path) -> list[Path]:
    """The metric files of a run folder of MLflow's file store (``<run>/metrics/**``)."""
    metrics = Path(run_dir) / "metrics"
    return sorted(p for p in metrics.rglob("*") if p.is_file()) if metrics.is_dir() else []


def drop_mlflow_metric_steps(run_dir: str | Path, first_step: int) -> int:
    """Remove every metric point at a step ``>= first_step`` from a run folder of MLflow's file store; the number
    of points removed.

    Each file is rewritten beside itself and moved over the old one (``os.replace``), so a reader sees the old or the
    new history, never half of one. A line without a step (MLflow < 1.0) counts as step 0, as MLflow reads it.
    """
    removed = 0
    for path in mlflow_metric_files(run_dir):
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _mlflow_line_step(line) < first_step]
        if len(kept) == len(lines):
            continue
        removed += len(lines) - len(kept)
        if not kept:  # MLflow refuses to read an empty metric file ("malformed"): the metric did not exist yet
            path.unlink()
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            out.writelines(kept)
        os.replace(tmp, path)
    return removed


def _mlflow_line_step(line: str) -> int:
    parts = line.split()
    return int(parts[2]) if len(parts) >= 3 else 0
