"""Hostile inputs that used to pass or to hang: YAML alias bombs, DoReMi weights resumed onto renamed or reordered
domains, initial weights trained with another tokenizer, and token ids outside the vocabulary in a shard.

Each is refused by the real entry point (``run_train.py`` or ``nanotron`` in a subprocess) with exit status 2 and
one ``error:`` line naming the key or file, and no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bad_inputs import ROOT, Outcome, assert_user_error, cli


def run_process(*args) -> Outcome:
    """``python ARGS`` in a fresh process from the repository root, on the CPU."""
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "NANOTRON_DEVICE": "cpu"})
    return Outcome(result.returncode, result.stdout, result.stderr)


# --- YAML alias bombs ----------------------------------------------------------------------------------------------

def _nested_aliases(levels: int) -> str:
    """A flow list of ``levels`` anchored lists, each holding the previous one 9 times: 9**levels values."""
    lists = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    lists += [f"&l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]" for level in range(1, levels)]
    return "[" + ", ".join(lists) + "]"


@pytest.mark.parametrize("document, key", [
    ("general:\n  project: {laughs}\n", "general.project[5]"),
    ("data_stages: {laughs}\n", "data_stages[5]"),
], ids=["general.project", "data_stages"])
def test_nested_yaml_aliases_are_refused_at_once(tmp_path, document, key):
    config = tmp_path / "laughs.yaml"
    config.write_text(document.format(laughs=_nested_aliases(7)))  # 9**7 = 4.8M values from 300 bytes
    fragments = (str(config), f"'{key}' holds more than 100,000 values once its YAML aliases", "write the values out")
    import nanotron.trainer  # noqa: F401  (imported by the command before it reads the config: not timed)

    start = time.perf_counter()
    outcome = cli("train", "--config-file", config)
    assert time.perf_counter() - start < 0.5
    assert_user_error(outcome, *fragments)
    assert_user_error(run_process("run_train.py", "--config-file", config), *fragments)


def test_an_alias_of_its_own_container_is_refused(tmp_path):
    config = tmp_path / "loop.yaml"
    config.write_text("general: &g\n  project: *g\n")
    assert_user_error(cli("train", "--config-file", config), str(config), "'general.project' is an alias of a value "
                                                                          "that contains it")
