"""The `nanotron` command: the data subcommands work end to end and bad input gives one `error:` line."""

import json
import subprocess
import sys


def nanotron(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanotron", *args], capture_output=True, text=True, timeout=300)


def test_train_tokenizer_then_preprocess(tiny_data, tmp_path):
    made = nanotron("train-tokenizer", "--input", str(tiny_data["corpus"]), "--vocab-size", "300",
                    "--output", str(tmp_path / "tok"))
    assert made.returncode == 0, made.stderr
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    assert json.loads(tokenizer.read_text())["model"]["type"] == "BPE"

    done = nanotron("preprocess", "--input", str(tiny_data["corpus"]), "--tokenizer", str(tokenizer),
                    "--output-folder", str(tmp_path / "data"), "--num-workers", "1")
    assert done.returncode == 0, done.stderr
    metadata = json.loads((tmp_path / "data" / "metadata.json").read_text())
    assert metadata["num_documents"] == 400 and metadata["tokenizer"]["vocab_size"] == 300


def test_user_errors_are_one_line_with_status_2(tmp_path):
    missing = tmp_path / "missing.txt"
    result = nanotron("preprocess", "--input", str(missing), "--tokenizer", "x", "--output-folder", str(tmp_path / "o"))
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and str(missing) in result.stderr and "Traceback" not in result.stderr

    result = nanotron("train", "--config-file", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "nope.yaml" in result.stderr


def test_train_frees_its_process_groups_before_returning(tiny_data, tmp_path, monkeypatch):
    """A gloo group joins its threads only when freed; the trainer's groups sit in reference cycles, and left to the
    interpreter's exit they were torn down beside its finalisation (a finished rank once aborted there)."""
    import gc
    import weakref

    import torch.distributed as dist

    from helpers import tiny_config_dict, write_config
    from nanotron.cli import main

    created = []
    new_group = dist.new_group

    def recorded(*args, **kwargs):
        group = new_group(*args, **kwargs)
        created.append(weakref.ref(group))
        return group

    monkeypatch.setattr(dist, "new_group", recorded)
    config = tiny_config_dict(tiny_data, tmp_path / "run")
    config["tokens"]["train_steps"] = 1
    gc.disable()  # no collection but the command's own: the test tells its collection from a chance one
    try:
        main(["train", "--config-file", str(write_config(tmp_path / "config.yaml", config))])
        alive = sum(ref() is not None for ref in created)
    finally:
        gc.enable()
    assert created and alive == 0, f"{alive} of {len(created)} process groups still alive"
