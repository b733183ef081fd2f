"""TensorBoard and Weights & Biases (offline) receive every step record of metrics.jsonl, read back with their own
readers; a tracker whose package is missing is refused before training."""

from __future__ import annotations

import json

import pytest

from support.configs import short_config, write_config
from support.runs import assert_user_error, cli, metrics, train_through_cli


def test_tensorboard_and_wandb_offline_hold_the_logged_steps(tiny_data, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    config = short_config(tiny_data, run, 3)
    config["logging"] |= {"tensorboard_dir": str(tmp_path / "tb"),
                          "wandb": {"project": "tests", "mode": "offline", "dir": str(tmp_path / "wb")}}
    train_through_cli(config, tmp_path / "config.yaml")
    records = metrics(run)

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key in ("lm_loss", "lr", "grad_norm", "tokens_per_sec"):
        logged = events.Scalars(key)
        assert [e.step for e in logged] == [1, 2, 3], key
        assert [e.value for e in logged] == pytest.approx([r[key] for r in records], rel=1e-6), key
    assert "config/text_summary" in events.Tags()["tensors"]

    (offline,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(offline)
    assert [int(h["_step"]) for h in history] == [1, 2, 3]
    assert [h["lm_loss"] for h in history] == pytest.approx([r["lm_loss"] for r in records], rel=1e-6)


def wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file: a LevelDB-style log (7-byte header after a 7-byte file header,
    32 KiB blocks) of W&B's own protobuf records."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, position, block, payloads, pending = path.read_bytes(), 7, 32768, [], b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        payload, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind in (1, 2):  # a whole record, or its first piece
            pending = payload
        elif kind in (3, 4):  # a middle or last piece
            pending += payload
        if kind in (1, 4):
            payloads.append(pending)
    rows = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_a_tracker_without_its_package_is_refused_before_training(tiny_data, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = short_config(tiny_data, tmp_path / "run", 2)
    config["logging"]["wandb"] = {"project": "tests", "mode": "offline"}
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      "logging.wandb is set but the wandb package is not installed", 'pip install -e ".[wandb]"')
    assert not (tmp_path / "run").exists()
