"""W&B (offline) and MLflow (file store) through ``logra-pl fit``: a run killed with SIGKILL after a checkpoint and
resumed with ``--ckpt_path last`` is one run in the store, with the same id, in which every step appears once with
the values of an uninterrupted run.

The stores are read back here with the backends' own formats: MLflow through ``MlflowClient`` on the file store;
W&B's offline transaction log (``run-<id>.wandb``) with a reader written in this file (wandb ships none in Python):
its LevelDB-log framing, checksums and ``wandb.proto`` records, replayed as ``wandb sync`` replays a run's segments.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import yaml

from logra_pl.runs import store_formats, stores

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
STEPS = 5  # logged at steps 0..4
# A checkpoint at update 3 (the resumed run logs from step 3); the kill comes after update 5, when the stopped run
# has logged steps 0..3 (a callback may have logged part of step 4): steps 3.. are logged twice unless the resume
# removes them.
FAST = [
    "--trainer.val_check_interval=100",
    "--trainer.enable_progress_bar=false",
    "--model.warm_start.steps=20",
    "--data.train_size=256",
    "--data.eval_size=32",
    "--data.prompts_per_step=16",
    "--model.microbatch_size=8",
    "--checkpoint.every_n_updates=3",
    f"--trainer.max_steps={STEPS}",
]
FIRST_RESUMED_STEP = 3
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
# wandb-core flushes its log every second (the CLI's default): the kill waits for two flushes.
KILL = [
    "--trainer.callbacks+=tests.helpers.kill.KillAt",
    "--trainer.callbacks.update=5",
    "--trainer.callbacks.wait_s=2.5",
]


def _wandb(folder: Path) -> dict[str, Any]:
    return {
        "class_path": "lightning.pytorch.loggers.WandbLogger",
        "init_args": {"save_dir": str(folder), "project": "tiny_cpu", "offline": True},
    }


def _mlflow(folder: Path) -> dict[str, Any]:
    return {
        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
        "init_args": {"experiment_name": "tiny_cpu", "tracking_uri": f"file:{folder / 'mlruns'}"},
    }


def _fit(folder: Path, loggers: list[dict[str, Any]], *extra: str) -> subprocess.CompletedProcess[str]:
    """``logra-pl fit`` in a child process (so it can be killed for real), logging to ``loggers``."""
    folder.mkdir(parents=True, exist_ok=True)
    overlay = folder / "loggers.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"logger": loggers}}))
    args = [sys.executable, "-m", "logra_pl.cli", "fit", f"--config={CONFIG}", f"--config={overlay}", *FAST, *extra]
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
    # What the CLI sets itself is tested: W&B's flush interval, MLflow's file-store opt-in.
    env.pop("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", None)
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    return subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, timeout=600)


# ------------------------------------------------------------------------------------------- W&B's offline log
def _wandb_log(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file: header ``:W&B`` + magic 0xBEE1 + version 0, then 32 KiB blocks of chunks
    (CRC-32 of type + payload, length, type: 1 full, 2 first, 3 middle, 4 last). A torn tail ends the log."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        if 32768 - offset % 32768 < 7:
            offset += 32768 - offset % 32768
            continue
        checksum, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        body = data[offset + 7 : offset + 7 + length]
        if kind == 0 or len(body) < length or zlib.crc32(bytes([kind]) + body) != checksum:
            break
        offset += 7 + length
        pending = body if kind in (1, 2) else pending + body
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
    return records


def _wandb_run(wandb_dir: Path) -> tuple[set[str], list[dict[str, Any]]]:
    """The run ids in ``wandb_dir`` and the history ``wandb sync`` would upload: each segment (one per ``fit``) in
    start order, a rewind (``resume_from``: a branch point on the run itself) keeping rows up to its ``_step``."""
    segments = []
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        records = _wandb_log(path)
        (run,) = [r.run for r in records if r.HasField("run")][:1]
        rows = [
            {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            | {"_step": r.history.step.num}
            for r in records
            if r.HasField("history")
        ]
        rewind = run.branch_point.value if run.branch_point.run == run.run_id else None
        segments.append((run.start_time.ToNanoseconds(), run.run_id, rewind, rows))
    history: list[dict[str, Any]] = []
    for _, _, rewind, rows in sorted(segments, key=lambda s: s[0]):
        history = [row for row in history if rewind is None or row["_step"] <= rewind] + rows
    return {s[1] for s in segments}, history


def _by_step(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(row["trainer/global_step"]), row[key]) for row in history if key in row]


# ------------------------------------------------------------------------------------------------------ MLflow
def _mlflow_runs(folder: Path) -> tuple[Any, list[Any]]:
    """A client of the file store in ``folder/mlruns`` and the runs of its ``tiny_cpu`` experiment."""
    from mlflow.tracking import MlflowClient

    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):  # MLflow >= 3.7 asks for the opt-in
        client = MlflowClient(f"file:{folder / 'mlruns'}")
        experiment = client.get_experiment_by_name("tiny_cpu")
        return client, client.search_runs([experiment.experiment_id])


def _mlflow_history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, float]]]:
    """The reference: 5 updates without interruption, logged to W&B and MLflow at once (each store's
    ``train/reward_mean`` by step)."""
    folder = tmp_path_factory.mktemp("straight")
    done = _fit(folder, [_wandb(folder), _mlflow(folder)])
    assert done.returncode == 0, done.stderr[-3000:]
    _, history = _wandb_run(folder / "wandb")
    client, (run,) = _mlflow_runs(folder)
    reference = {
        "wandb": _by_step(history, "train/reward_mean"),
        "mlflow": _mlflow_history(client, run.info.run_id, "train/reward_mean"),
    }
    assert reference["wandb"] == reference["mlflow"]  # the two stores hold the same values
    assert [step for step, _ in reference["wandb"]] == list(range(STEPS))
    return reference


@pytest.mark.system
@pytest.mark.slow
def test_kill9_then_resume_last_continues_the_wandb_and_mlflow_runs_with_each_step_once(
    tmp_path: Path, straight: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run logging to W&B (offline) and MLflow (file store) at once, killed after update 5 (checkpoint at 3),
    then resumed: each store holds one run, the checkpoint's, with steps 0..4 once and the uninterrupted values."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the MLflow store too
    loggers = [_wandb(tmp_path), _mlflow(tmp_path)]
    killed = _fit(tmp_path, loggers, *KILL)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (ckpt,) = (tmp_path / "tiny_cpu").glob("*/checkpoints/last.ckpt")  # the first logger's (W&B's) run folder
    saved = torch.load(ckpt, weights_only=False)
    assert saved["global_step"] == FIRST_RESUMED_STEP
    wandb_run, mlflow_run = saved["logra_pl"]["loggers"]
    assert wandb_run["kind"] == "wandb" and wandb_run["run_id"] == ckpt.parents[1].name and wandb_run["offline"]
    assert mlflow_run["kind"] == "mlflow"
    # The stopped run got past the checkpoint: step 3 is in both stores before the resume.
    _, before = _wandb_run(tmp_path / "wandb")
    assert [step for step, _ in _by_step(before, "train/reward_mean")] == list(range(FIRST_RESUMED_STEP + 1))
    client, (run,) = _mlflow_runs(tmp_path)
    assert run.info.run_id == mlflow_run["run_id"]
    logged = [step for step, _ in _mlflow_history(client, run.info.run_id, "train/reward_mean")]
    assert logged == list(range(FIRST_RESUMED_STEP + 1))

    resumed = _fit(tmp_path, loggers, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for label, record in (("W&B", wandb_run), ("MLflow", mlflow_run)):
        assert f"{label}: continuing run {record['run_id']} at step {FIRST_RESUMED_STEP}" in resumed.stderr
    # The end-of-run lines say where each run is and how to look at it.
    wandb_dir = (tmp_path / "wandb").resolve()
    assert f"W&B offline run {wandb_run['run_id']} in {wandb_dir}   (upload: wandb sync {wandb_dir})" in resumed.stderr
    assert f"MLflow run {mlflow_run['run_id']}   (mlflow ui --backend-store-uri file:{tmp_path / 'mlruns'})" in (
        resumed.stderr
    )

    assert (ckpt.parents[1] / "hf" / "final" / "config.json").is_file()  # exported into the run's folder

    # W&B: both segments (one per fit) carry the checkpoint's run id; replayed, each step once.
    ids, history = _wandb_run(tmp_path / "wandb")
    assert ids == {wandb_run["run_id"]} and len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2
    assert _by_step(history, "train/reward_mean") == straight["wandb"]  # each step once, the uninterrupted values
    steps = [row["trainer/global_step"] for row in history if "trainer/global_step" in row]
    assert steps == list(range(STEPS))  # no row of any metric repeats a step

    # MLflow: one run, the checkpoint's, finished; no metric holds a step twice.
    client, runs = _mlflow_runs(tmp_path)
    assert [r.info.run_id for r in runs] == [mlflow_run["run_id"]]
    assert _mlflow_history(client, mlflow_run["run_id"], "train/reward_mean") == straight["mlflow"]
    for key in runs[0].data.metrics:
        steps = [step for step, _ in _mlflow_history(client, mlflow_run["run_id"], key)]
        assert len(steps) == len(set(steps)), key
    assert runs[0].info.status == "FINISHED"


# ------------------------------------------------------------------------------------------------ fast checks
def test_wandb_reader_reads_what_wandb_writes_and_stops_at_a_torn_tail(tmp_path: Path) -> None:
    """logra-pl's reader (store_formats) against a log wandb-core wrote, and against the same log cut mid-record."""
    import wandb

    run = wandb.init(project="p", dir=tmp_path, mode="offline", id="r1", settings=wandb.Settings(silent=True))
    for step in range(40):
        run.log({"x": step * 0.5, "trainer/global_step": step})
    run.finish()
    wandb.teardown()  # finish() returns before wandb-core has closed the log; teardown waits for it
    (path,) = tmp_path.glob("wandb/offline-run-*-r1/run-r1.wandb")
    segment = store_formats.read_wandb_segment(path)
    assert segment.run_id == "r1" and segment.rewind_to is None
    assert [(row["_step"], row["x"]) for row in segment.rows] == [(s, s * 0.5) for s in range(40)]
    assert len(_wandb_log(path)) == len(list(store_formats.wandb_records(path)))  # the test's reader agrees
    torn = tmp_path / "torn.wandb"
    data = path.read_bytes()
    torn.write_bytes(data[: len(data) // 2])
    rows = store_formats.read_wandb_segment(torn).rows
    assert 0 < len(rows) < 40 and [row["_step"] for row in rows] == list(range(len(rows)))


def test_mlflow_points_at_and_after_a_step_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{tmp_path}")
    experiment = client.create_experiment("e")
    run = client.create_run(experiment).info.run_id
    client.log_batch(run, metrics=[Metric("a/b", float(s), 0, s) for s in range(6)])
    client.log_batch(run, metrics=[Metric("late", 1.0, 0, 5)])  # first logged after the cut: disappears
    removed = store_formats.drop_mlflow_metric_steps(tmp_path / experiment / run, 4)
    assert removed == 3
    assert [(m.step, m.value) for m in client.get_metric_history(run, "a/b")] == [(s, float(s)) for s in range(4)]
    assert set(client.get_run(run).data.metrics) == {"a/b"} and client.get_run(run).data.metrics["a/b"] == 3.0


def test_resume_point_knows_the_last_logged_step() -> None:
    assert stores.ResumePoint(3, Path("x")).last_logged_step == 2
    assert stores.ResumePoint(120, Path("x"), log_every_n_steps=50).last_logged_step == 99
    assert stores.ResumePoint(10, Path("x"), log_every_n_steps=50).last_logged_step == -1


def test_mlflow_store_continues_the_run_drops_later_points_and_keeps_first_params(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning's MLFlowLogger, without a Trainer: a run that logged steps 0..5 is resumed at step 3 with a changed
    setting; the resumed logger writes into the same run, steps 3.. once, and the changed param becomes a tag."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from lightning.pytorch.loggers import MLFlowLogger

    uri = f"file:{tmp_path / 'mlruns'}"
    first = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    first.log_hyperparams({"rollout": {"max_new_tokens": 8}, "seed": 0})
    for step in range(6):
        first.log_metrics({"train/reward_mean": step / 10}, step=step)
    record = stores.store_for(first).record()
    assert record["kind"] == "mlflow" and record["run_id"] == first.run_id

    second = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    notes = stores.store_for(second).resume(record, stores.ResumePoint(3, tmp_path / "last.ckpt"))
    assert notes == [
        f"MLflow: continuing run {first.run_id} at step 3 (3 metric point(s) the stopped run logged at steps >= 3 "
        f"removed from {tmp_path / 'mlruns' / record['experiment_id'] / first.run_id})"
    ]
    caplog.set_level("WARNING", logger="logra_pl")
    second.log_hyperparams({"rollout": {"max_new_tokens": 6}, "seed": 0})  # MLflow alone would raise here
    for step in range(3, 5):
        second.log_metrics({"train/reward_mean": step / 100}, step=step)
    assert second.run_id == first.run_id
    history = sorted((m.step, m.value) for m in second.experiment.get_metric_history(first.run_id, "train/reward_mean"))
    assert history == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.03), (4, 0.04)]
    run = second.experiment.get_run(first.run_id)
    assert run.data.params == {"rollout/max_new_tokens": "8", "seed": "0"}
    assert run.data.tags["logra_pl.resumed/step_3/rollout/max_new_tokens"] == "6"
    assert "rollout/max_new_tokens 8 → 6" in caplog.text


def test_mlflow_store_with_another_run_id_or_store_starts_a_new_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from lightning.pytorch.loggers import MLFlowLogger

    record = {"kind": "mlflow", "run_id": "abc", "experiment_id": "1", "tracking_uri": f"file:{tmp_path / 'a'}"}
    other = MLFlowLogger(experiment_name="e", tracking_uri=f"file:{tmp_path / 'b'}")
    (note,) = stores.store_for(other).resume(record, stores.ResumePoint(7, tmp_path / "last.ckpt"))
    assert note.startswith(f"MLflow: the checkpoint's steps 0..6 are in run abc in file:{tmp_path / 'a'}")
    assert other.run_id != "abc"


def test_wandb_store_rewinds_to_the_last_row_before_the_resumed_step(tmp_path: Path) -> None:
    """Lightning's WandbLogger, offline, without a Trainer: steps 0..5 logged, resumed at step 3 → the new segment
    rewinds to the row of step 2, and the run as `wandb sync` replays it holds each step once."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    first = WandbLogger(save_dir=str(tmp_path), project="p", offline=True)
    for step in range(6):
        first.log_metrics({"train/reward_mean": step / 10}, step=step)
    record = stores.store_for(first).record()
    wandb.finish()
    wandb.teardown()  # finish() returns before wandb-core has closed the log
    assert record["kind"] == "wandb" and record["offline"] and record["project"] == "p"

    second = WandbLogger(save_dir=str(tmp_path), project="p", offline=True)
    (note,) = stores.store_for(second).resume(record, stores.ResumePoint(3, tmp_path / "last.ckpt"))
    assert note.startswith(
        f"W&B: continuing run {record['run_id']} at step 3, rewound to its history row _step=2 (3 row(s) the stopped "
        "run logged after the checkpoint are dropped by `wandb sync`); rewinding is a preview feature"
    )
    for step in range(3, 5):
        second.log_metrics({"train/reward_mean": step / 100}, step=step)
    assert second.experiment.id == record["run_id"]
    wandb.finish()
    wandb.teardown()
    ids, history = _wandb_run(tmp_path / "wandb")
    assert ids == {record["run_id"]}
    assert _by_step(history, "train/reward_mean") == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.03), (4, 0.04)]


def test_wandb_store_names_the_steps_a_kill_lost(tmp_path: Path) -> None:
    """A log that ends before the checkpoint's last step (wandb-core had not flushed it): the resume says which."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    first = WandbLogger(save_dir=str(tmp_path), project="p", offline=True)
    for step in range(2):
        first.log_metrics({"train/reward_mean": 0.5}, step=step)
    record = stores.store_for(first).record()
    wandb.finish()
    wandb.teardown()
    second = WandbLogger(save_dir=str(tmp_path), project="p", offline=True)
    notes = stores.store_for(second).resume(record, stores.ResumePoint(5, tmp_path / "last.ckpt"))
    assert notes[1].startswith(f"W&B: steps 2..4 are missing from run {record['run_id']}")
    assert stores.compat.wandb_init_args(second)["resume_from"] == f"{record['run_id']}?_step=1"


def test_checkpoint_folders_of_each_logger_are_found_before_it_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ckpt_path last`` searches each logger's run family: W&B ``<save_dir>/<project>``, MLflow
    ``<store>/<experiment id>``, TensorBoard ``<save_dir>/<name>``; ``*/checkpoints/last*.ckpt`` under each."""
    from mlflow.tracking import MlflowClient

    from logra_pl.runs.resume import find_last_checkpoint

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the CLI allows a file store a config names
    wandb_entry = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": str(tmp_path)}}
    wandb_entry["init_args"]["project"] = "p"
    assert stores.family_roots(wandb_entry, tmp_path) == [tmp_path / "p"]
    uri = f"file:{tmp_path / 'mlruns'}"
    mlflow_entry = {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {"tracking_uri": uri}}
    assert stores.family_roots(mlflow_entry, tmp_path) == []  # no experiment yet: nothing to resume
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    experiment = MlflowClient(uri).create_experiment("lightning_logs")
    (root,) = stores.family_roots(mlflow_entry, tmp_path)
    assert root == tmp_path / "mlruns" / experiment
    ckpt = root / "0123abcd" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    assert find_last_checkpoint([tmp_path / "p", root]) == ckpt
    tb_entry = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "r", "name": "n"},
    }
    assert stores.family_roots(tb_entry, tmp_path) == [Path("r") / "n"]


def test_a_resume_with_other_loggers_says_where_the_earlier_steps_are(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    note = stores.other_runs_note([{"kind": "wandb", "run_id": "abc"}], {"mlflow"}, 7)
    assert note == "steps 0..6 of this run were logged to W&B run abc; this run's loggers start at step 7"
    assert stores.other_runs_note([{"kind": "wandb", "run_id": "abc"}], {"wandb"}, 7) is None
    (note,) = stores.store_for(CSVLogger(tmp_path)).resume(None, stores.ResumePoint(7, tmp_path / "x.ckpt"))
    assert note.startswith("CSVLogger: logra-pl continues TensorBoard, W&B and MLflow runs on resume; this logger")
    assert "starts a new run at step 7" in note


def test_wandb_store_leaves_the_rows_when_the_user_asks_for_wandbs_plain_resume(tmp_path: Path) -> None:
    """``trainer.logger.init_args.resume: must`` opts out of the rewind (a W&B server without it): said, not hidden."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    first = WandbLogger(save_dir=str(tmp_path), project="p", offline=True)
    first.log_metrics({"train/reward_mean": 0.5}, step=0)
    record = stores.store_for(first).record()
    wandb.finish()
    wandb.teardown()
    second = WandbLogger(save_dir=str(tmp_path), project="p", offline=True, resume="must")
    (note,) = stores.store_for(second).resume(record, stores.ResumePoint(2, tmp_path / "last.ckpt"))
    assert "without a rewind" in note and "so those steps appear twice" in note
    args = stores.compat.wandb_init_args(second)
    assert (args["id"], args["resume"], "resume_from" in args) == (record["run_id"], "must", False)
