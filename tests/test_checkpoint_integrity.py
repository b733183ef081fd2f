"""Checkpoints that cannot be trusted or cannot be written, through the real mechanisms: a hand-edited
checkpoint.json, a file list naming what no save writes (a path elsewhere, a symbolic link out, a device, a pipe), a
disk that fills up inside safetensors' own write, and an old checkpoint that cannot be pruned; same-size corruption,
a planted pickle, a corrupt checkpoint.json, a full disk or an unwritable folder at any save, a ``latest.txt``
pointing elsewhere; and background saves writing what foreground ones write.

A full disk is a small tmpfs mounted in a user and mount namespace of the training process where the system allows
one, and a file-size limit (RLIMIT_FSIZE) on it; a folder that cannot be deleted is a read-only bind mount (or, where
namespaces are not allowed, read-only permissions). Commands that need a limit or a namespace, or that would hang,
run as processes of their own.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nanotron.checkpoint.integrity import file_entry
from nanotron.checkpoint.manager import write_metadata
from support.configs import short_config, write_config
from support.runs import (
    Outcome,
    assert_user_error,
    checkpoint_json,
    checkpoint_steps,
    cli,
    fresh_environment,
    train_through_cli,
)

MODEL_FILE = "model/pp000-tp000-ep000.safetensors"  # the first file a save writes, through safetensors (~400 kB)
FREE_BYTES = 128 * 1024  # room left on a full disk: less than that file, more than a step's other writes


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    """A run folder trained 2 steps (checkpoint 2); tests work on copies of it."""
    root = tmp_path_factory.mktemp("trained")
    train_through_cli(short_config(tiny_data, root / "run", 2), root / "config.yaml")
    return root / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _eval(run: Path, tiny_data) -> Outcome:
    return cli("eval", "--ckpt-path", run, "--data", tiny_data["tokenized"], "--sequence-length", 16,
               "--max-windows", 2)


def _resume(run: Path, tiny_data, tmp_path: Path) -> Outcome:
    config = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(run)})
    return cli("train", "--config-file", write_config(tmp_path / "resume.yaml", config))


def _nanotron(*args, prefix: tuple[str, ...] = (), preexec_fn=None, timeout: float = 300) -> Outcome:
    """``nanotron ARGS`` as a process of its own: a limit or a namespace applies to it alone, and a hang times out."""
    result = subprocess.run([*prefix, sys.executable, "-m", "nanotron", *map(str, args)], capture_output=True,
                            text=True, timeout=timeout, preexec_fn=preexec_fn,
                            env=fresh_environment(OMP_NUM_THREADS="1"))
    return Outcome(result.returncode, result.stdout, result.stderr)


def _mounts_allowed() -> bool:
    """Whether a process may mount a tmpfs in a user and mount namespace of its own (unshare -Urm)."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "tmpfs",
                                   folder], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


MOUNTS_ALLOWED = _mounts_allowed()


def _in_a_mount_namespace(args, setup: str, teardown: str = "") -> Outcome:
    """``nanotron ARGS`` in a user and mount namespace of its own, after the shell commands ``setup`` and before
    ``teardown``: whatever they mount vanishes with the process."""
    if not MOUNTS_ALLOWED:
        pytest.skip("this system allows no user and mount namespace (unshare -Urm) to mount a filesystem in")
    script = f'{setup} || exit 99\n"$@"\nstatus=$?\n{teardown}\nexit $status'
    return _nanotron(*args, prefix=("unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"))


def _on_a_full_filesystem(run: Path, args) -> Outcome:
    """``nanotron ARGS`` with ``run`` on a tmpfs that has FREE_BYTES left; ``run`` then holds what it left there."""
    contents = run.with_name("contents")
    shutil.copytree(run, contents)
    folder, copy, filler = (shlex.quote(str(path)) for path in (run, contents, run / "filler"))
    setup = (f"mount -t tmpfs -o size=64m tmpfs {folder} && cp -a {copy}/. {folder}/ && "
             f"head -c $(( $(df --output=avail -B1 {folder} | tail -n 1) - {FREE_BYTES} )) /dev/zero > {filler}")
    outcome = _in_a_mount_namespace(args, setup, teardown=f"rm {filler}; rm -r {copy}; cp -a {folder} {copy}")
    shutil.rmtree(run)
    contents.rename(run)
    return outcome


def _with_a_file_size_limit(run: Path, args) -> Outcome:
    """``nanotron ARGS`` allowed no file over FREE_BYTES: RLIMIT_FSIZE (Python ignores SIGXFSZ, so a write past the
    limit fails with EFBIG)."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    return _nanotron(*args, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (FREE_BYTES, hard)))


def _with_a_read_only_folder(folder: Path, args) -> Outcome:
    """``nanotron ARGS`` while ``folder`` cannot be changed: a read-only bind mount (permissions stop no root
    process), or read-only permissions where no namespace is allowed."""
    if MOUNTS_ALLOWED:
        path = shlex.quote(str(folder))
        return _in_a_mount_namespace(args, f"mount --bind {path} {path} && mount -o remount,bind,ro {path}")
    if os.geteuid() == 0:
        pytest.skip("root ignores permissions and this system allows no namespace for a read-only mount")
    folder.chmod(0o555)
    try:
        return _nanotron(*args)
    finally:
        folder.chmod(0o755)


# --- checkpoint.json carries a checksum of its own content -------------------------------------------------------

def _edited(metadata: dict, key: str, value) -> dict:
    *parents, last = key.split(".")
    inner = metadata
    for parent in parents:
        inner = inner[parent]
    inner[last] = value
    return metadata


@pytest.mark.parametrize("key, value", [("step", 5), ("consumed_samples", {"main": 0}),
                                        ("model.config.rope_theta", 500000.0)],
                         ids=["step", "consumed_samples", "rope_theta"])
@pytest.mark.slow
def test_a_hand_edited_checkpoint_json_is_refused_by_every_loader(run, tiny_data, tmp_path, key, value):
    file = run / "2" / "checkpoint.json"
    assert cli("checkpoint", "verify", run).code == 0
    file.write_text(json.dumps(_edited(json.loads(file.read_text()), key, value), indent=2, sort_keys=True))
    expected = (str(file), "was modified after it was saved", "restore the original file")
    assert_user_error(cli("checkpoint", "verify", run), *expected)
    assert_user_error(_eval(run, tiny_data), *expected)
    assert_user_error(_resume(run, tiny_data, tmp_path), *expected)
    assert not (tmp_path / "resumed" / "latest.txt").exists()


def test_checkpoints_of_format_2_load_without_a_manifest_checksum_and_later_ones_need_it(run, tiny_data):
    file = run / "2" / "checkpoint.json"
    metadata = json.loads(file.read_text())
    metadata.pop("manifest_sha256", None)
    file.write_text(json.dumps(metadata | {"format_version": 2}, indent=2, sort_keys=True))
    assert cli("checkpoint", "verify", run).code == 0
    assert _eval(run, tiny_data).code == 0
    file.write_text(json.dumps(metadata | {"format_version": 3}, indent=2, sort_keys=True))
    assert_user_error(cli("checkpoint", "verify", run), str(file), "has no manifest_sha256")


def test_a_checkpoint_of_format_1_is_refused_by_every_loader(run, tiny_data, tmp_path):
    """Format 1 (no model family, files by size alone) never left development: refused in one line, not guessed."""
    file = run / "2" / "checkpoint.json"
    metadata = json.loads(file.read_text())
    metadata.pop("manifest_sha256", None)
    file.write_text(json.dumps(metadata | {"format_version": 1}, indent=2, sort_keys=True))
    expected = (str(run / "2"), "has format 1", "this version reads formats 2 to 3")
    assert_user_error(cli("checkpoint", "verify", run), *expected)
    assert_user_error(_eval(run, tiny_data), *expected)
    assert_user_error(_resume(run, tiny_data, tmp_path), *expected)


def test_a_model_config_of_the_wrong_type_in_checkpoint_json_is_one_line_naming_the_key(run, tiny_data):
    """checkpoint.json's model config is read as a YAML file's is (keys, types, Literal values), whoever sealed it."""
    file = run / "2" / "checkpoint.json"
    metadata = json.loads(file.read_text())
    metadata["model"]["config"]["hidden_size"] = "64"
    write_metadata(file.parent, metadata)
    assert_user_error(_eval(run, tiny_data), str(file), "model config this version cannot read",
                      "hidden_size: expected an integer, got '64'")


def test_a_model_config_saved_with_upstream_fields_nothing_reads_still_loads(run, tiny_data, tmp_path):
    """checkpoint.json of the versions whose schema still held upstream's unread fields, at the values they saved."""
    file = run / "2" / "checkpoint.json"
    metadata = json.loads(file.read_text())
    metadata["model"]["config"] |= {"rope_interleaved": False, "pretraining_tp": 1, "use_cache": True}
    write_metadata(file.parent, metadata)
    assert _eval(run, tiny_data).code == 0
    resumed = _resume(run, tiny_data, tmp_path)
    assert resumed.code == 0, resumed.stderr[-3000:]


# --- the file list names regular files inside the checkpoint folder, nothing else --------------------------------

def _a_path_outside(checkpoint: Path, tmp_path: Path) -> tuple[str, dict]:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(64))
    return os.path.relpath(outside, checkpoint), file_entry(outside)  # ../../outside.bin


def _a_device(checkpoint: Path, tmp_path: Path) -> tuple[str, dict]:
    return "/dev/zero", {"bytes": 0, "crc32": "00000000"}  # its size is 0, its reading never ends


def _a_symbolic_link_out(checkpoint: Path, tmp_path: Path) -> tuple[str, dict]:
    """The model's weights moved out of the folder and linked back: the same bytes, loaded from elsewhere."""
    elsewhere = tmp_path / "weights.safetensors"
    shutil.move(checkpoint / MODEL_FILE, elsewhere)
    (checkpoint / MODEL_FILE).symlink_to(elsewhere)
    return MODEL_FILE, file_entry(elsewhere)


def _a_pipe(checkpoint: Path, tmp_path: Path) -> tuple[str, dict]:
    os.mkfifo(checkpoint / "rng" / "pipe")  # opening it waits for a writer forever
    return "rng/pipe", {"bytes": 0, "crc32": "00000000"}


def _plant(run: Path, tmp_path: Path, plant) -> str:
    """List what ``plant`` makes in checkpoint.json, sealed again: only the rule on paths can refuse it."""
    checkpoint = run / "2"
    metadata = json.loads((checkpoint / "checkpoint.json").read_text())
    name, entry = plant(checkpoint, tmp_path)
    write_metadata(checkpoint, metadata | {"files": metadata["files"] | {name: entry}})
    return name


@pytest.mark.parametrize("plant", [_a_path_outside, _a_symbolic_link_out], ids=["parent-path", "symlink-out"])
def test_a_file_list_naming_a_file_outside_the_checkpoint_is_refused_by_every_loader(run, tiny_data, tmp_path, plant):
    name = _plant(run, tmp_path, plant)
    expected = f"lists {name!r}, which is not a regular file inside {run / '2'}"
    assert_user_error(cli("checkpoint", "verify", run), expected)
    assert_user_error(_eval(run, tiny_data), expected)
    assert_user_error(_resume(run, tiny_data, tmp_path), expected)


@pytest.mark.parametrize("plant", [_a_device, _a_pipe], ids=["device", "fifo"])
@pytest.mark.slow
def test_a_file_list_naming_a_device_or_a_pipe_is_refused_instead_of_hanging(run, tmp_path, plant):
    name = _plant(run, tmp_path, plant)
    outcome = _nanotron("checkpoint", "verify", run, timeout=120)  # a process of its own: reading one never ends
    assert_user_error(outcome, f"lists {name!r}, which is not a regular file inside {run / '2'}")


# --- a full disk during a save ---------------------------------------------------------------------------------

@pytest.mark.parametrize("full", [_on_a_full_filesystem, pytest.param(_with_a_file_size_limit,
                                                                     marks=pytest.mark.full_tier)],
                         ids=["full-filesystem", "file-size-limit"])
@pytest.mark.slow
def test_a_disk_full_inside_safetensors_keeps_the_previous_checkpoint_and_the_run_resumes(run, tiny_data, tmp_path,
                                                                                         full):
    config = short_config(tiny_data, run, 3, checkpoints={"checkpoint_interval": 1, "resume_checkpoint_path": "auto"})
    outcome = full(run, ["train", "--config-file", write_config(tmp_path / "config.yaml", config)])
    assert_user_error(outcome, f"while saving checkpoint 3 (writing {run / '.tmp-3' / MODEL_FILE})",
                      "(the size of the previous checkpoint)", "are free",
                      "checkpoint 2 is intact and still the latest")
    assert sorted(p.name for p in run.iterdir()) == ["2", "latest.txt", "metrics.jsonl"]  # no partial save
    assert not [p for p in run.rglob(".*")]  # nor any temporary file
    assert (run / "latest.txt").read_text().strip() == "2" and cli("checkpoint", "verify", run).code == 0
    assert "resumed from" in train_through_cli(config, tmp_path / "again.yaml").stderr
    assert checkpoint_json(run)["step"] == 3


# --- pruning old checkpoints ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_an_old_checkpoint_that_cannot_be_deleted_is_kept_with_a_warning_at_every_save(run, tiny_data, tmp_path):
    config = short_config(tiny_data, run, 4, checkpoints={"checkpoint_interval": 1, "keep_last_n": 1,
                                                          "resume_checkpoint_path": "auto"})
    outcome = _with_a_read_only_folder(run / "2", ["train", "--config-file", write_config(tmp_path / "c.yaml", config)])
    assert outcome.code == 0, outcome.stderr[-3000:]
    assert outcome.stderr.count(f"could not delete the old checkpoint {run / '2'}") == 2  # after saving 3, and 4
    assert checkpoint_steps(run) == ["2", "4"] and (run / "latest.txt").read_text().strip() == "4"
    assert cli("checkpoint", "verify", run / "2").code == 0  # kept whole


# --- damaged files, full disks and stray latest.txt files -----------------------------------------------------------

def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.slow
def test_same_size_corruption_is_named_by_every_loader(saved, tiny_data, tmp_path):
    weights = next((saved["checkpoint"] / "model").glob("*.safetensors"))
    assert cli("checkpoint", "verify", saved["run"]).code == 0
    _flip_a_byte(weights)
    expected = (str(weights), "does not match its checksum")
    assert_user_error(cli("checkpoint", "verify", saved["run"]), *expected)
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)), *expected)
    assert_user_error(cli("eval", "--ckpt-path", saved["run"], "--data", tiny_data["tokenized"],
                          "--sequence-length", "16"), *expected)
    assert_user_error(cli("generate", "--ckpt-path", saved["run"], "--prompt", "the"), *expected)
    assert_user_error(cli("convert", "nanotron-to-hf", "--ckpt-path", saved["run"], "--save-path", tmp_path / "hf"),
                      *expected)


@pytest.mark.slow
def test_corrupt_optimizer_state_is_named_not_reported_as_divergence(saved, tiny_data, tmp_path):
    state = next((saved["checkpoint"] / "optimizer").glob("*.safetensors"))
    _flip_a_byte(state)
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    line = assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)),
                             str(state), "checksum")
    assert "learning_rate" not in line


class _Payload:
    """Unpickling this creates a file: proof that a load executed code from the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.slow
def test_a_planted_pickle_is_never_loaded(saved, tiny_data, tmp_path):
    from nanotron.checkpoint.manager import write_metadata

    rng = saved["checkpoint"] / "rng"
    marker = tmp_path / "executed"
    for file in rng.iterdir():  # a pickled rng file with a payload, and no other rng state
        file.unlink()
    (rng / "rank-00000.pt").write_bytes(pickle.dumps({"coords": {}, "state": _Payload(marker)}))
    metadata = json.loads((saved["checkpoint"] / "checkpoint.json").read_text())
    metadata["files"] = {name: entry for name, entry in metadata["files"].items() if not name.startswith("rng/")}
    write_metadata(saved["checkpoint"], metadata)
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    outcome = train_through_cli(resume, tmp_path / "resume.yaml")
    assert not marker.exists()
    assert "random states re-derived from the seed" in outcome.stderr


@pytest.mark.parametrize("damage, fragment", [
    (lambda m: "{not json", "cannot read"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "consumed_samples"}), "'consumed_samples' is missing"),
    (lambda m: json.dumps(m | {"step": "two"}), "'step' is missing or not an int (got 'two')"),
], ids=["bad-json", "missing-key", "step-not-an-integer"])
@pytest.mark.slow
def test_a_corrupt_checkpoint_json_is_one_error(saved, tiny_data, tmp_path, damage, fragment):
    file = saved["checkpoint"] / "checkpoint.json"
    file.write_text(damage(json.loads(file.read_text())))
    resume = short_config(tiny_data, tmp_path / "resumed", 3,
                          checkpoints={"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)), fragment)
    assert_user_error(cli("eval", "--ckpt-path", saved["run"], "--data", tiny_data["tokenized"]), fragment)


@pytest.mark.slow
def test_latest_pointing_outside_the_run_folder_is_refused(saved, tiny_data, tmp_path):
    (saved["run"] / "latest.txt").write_text("../../elsewhere\n")
    assert_user_error(cli("checkpoint", "verify", saved["run"]), "latest.txt names '../../elsewhere'")


def _save_into_a_full_disk(config: dict) -> dict:
    import nanotron.files as files
    from nanotron.config import config_from_dict
    from nanotron.errors import CheckpointError
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()  # saves step 2 normally

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    files.save_file = full
    trainer.progress.step = 3
    try:
        trainer.save()
        trainer.wait_for_saves()  # an asynchronous save reports its failure here
        message = None
    except CheckpointError as error:
        message = str(error)
    return {"message": message}


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["foreground", "background"])
@pytest.mark.slow
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_how_much_is_needed(tiny_data, tmp_path, async_save):
    from support.distributed import run_distributed

    run = tmp_path / "run"
    config = short_config(tiny_data, run, 2, parallelism={"dp": 2})
    config["checkpoints"]["async_save"] = async_save
    config["tokens"]["micro_batch_size"] = 2
    results = run_distributed(_save_into_a_full_disk, 2, config=config)
    for result in results:  # every rank reports the same error instead of waiting for the others
        assert "no space left on the device" in result["message"] and "(the size of the previous" in result["message"]
    assert checkpoint_steps(run) == ["2"] and not list(run.glob(".tmp-*"))
    assert (run / "latest.txt").read_text().strip() == "2"


def test_an_unwritable_checkpoint_folder_is_refused_before_training(tiny_data, tmp_path):
    (tmp_path / "file").write_text("")
    config = short_config(tiny_data, tmp_path / "file" / "run", 2)
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                      "checkpoints.checkpoints_path", "is not writable")


@pytest.mark.slow
def test_background_saves_write_the_same_checkpoints_as_foreground_ones(tiny_data, tmp_path):
    runs = {}
    for async_save in (False, True):
        run = tmp_path / f"async-{async_save}"
        train_through_cli(short_config(tiny_data, run, 6, checkpoints={"checkpoint_interval": 2,
                                                                       "async_save": async_save}),
                          tmp_path / f"{async_save}.yaml")
        runs[async_save] = run
    assert checkpoint_steps(runs[True]) == ["2", "4", "6"] and cli("checkpoint", "verify", runs[True]).code == 0
    for step in ("2", "4", "6"):
        files = [json.loads((runs[a] / step / "checkpoint.json").read_text())["files"] for a in (False, True)]
        tensors = {name: entry["crc32"] for name, entry in files[0].items() if name.startswith(("model/", "optim"))}
        assert tensors and tensors == {name: files[1][name]["crc32"] for name in tensors}
