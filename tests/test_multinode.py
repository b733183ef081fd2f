"""Several nodes, simulated on this machine: a run spread over two torchrun agents joined by a c10d rendezvous
trains exactly as the same layout launched from one agent, and examples/slurm/train.sbatch (with stand-ins for
``srun`` and ``scontrol``) starts one agent per node and stops every rank with a checkpoint on its signal."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT
from support.configs import short_config, write_config
from support.parity import assert_reference_trains
from support.processes import descendants, killed_on_failure, signal_all, wait_for_all
from support.runs import checkpoint_json, fresh_environment, metrics
from support.tiers import parity_steps

TIMEOUT_S = 240
ENV = fresh_environment(OMP_NUM_THREADS="1")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_orphans(pids: list[int], marker: str) -> None:
    """Those of ``pids`` still running a command that names ``marker``: workers whose agent died, reparented and so
    out of reach of ``kill_with_descendants``."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)


def _run_agents(config_path: Path, agents: list[list[str]]) -> None:
    """One torchrun per argument list, all at once. Output goes to files: a full pipe would block an agent."""
    logs = [config_path.with_suffix(f".agent{i}.log") for i in range(len(agents))]
    processes = []
    for args, log in zip(agents, logs):
        with open(log, "w") as out:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *args, str(ROOT / "run_train.py"),
                 "--config-file", str(config_path)], stdout=out, stderr=subprocess.STDOUT, env=ENV))
    wait_for_all(processes, logs, TIMEOUT_S)


def _dp2_tp2(tiny_data, run: Path, steps: int) -> dict:
    config = short_config(tiny_data, run, steps, parallelism={"dp": 2, "tp": 2})
    config["tokens"]["micro_batch_size"] = 2  # the tiny config's global batch of 8 sequences, over dp=2
    return config


@pytest.mark.full_tier
def test_two_nodes_train_exactly_as_one(tiny_data, tmp_path):
    steps = parity_steps()
    one_node = write_config(tmp_path / "one_node.yaml", _dp2_tp2(tiny_data, tmp_path / "one_node", steps))
    two_nodes = write_config(tmp_path / "two_nodes.yaml", _dp2_tp2(tiny_data, tmp_path / "two_nodes", steps))
    _run_agents(one_node, [["--standalone", "--nproc-per-node", "4"]])
    # c10d as under Slurm (node ranks come from the rendezvous, in order of arrival). Both agents match the
    # endpoint's host here, so the first to bind its port hosts the rendezvous and the other joins as a client.
    agent = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "two-nodes"]
    _run_agents(two_nodes, [agent, agent])

    reference, spread = metrics(tmp_path / "one_node"), metrics(tmp_path / "two_nodes")
    assert_reference_trains(reference, steps)
    assert [r["step"] for r in spread] == [r["step"] for r in reference]
    for one, two in zip(reference, spread):
        assert two["lm_loss"] == pytest.approx(one["lm_loss"], rel=1e-6, abs=0), (one, two)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6, abs=0), (one, two)


# A node list of two hosts that are both this machine, and an srun that runs its command once per node in the
# background, with --output's %x, %j and %N filled in (%N by node0, node1).
SCONTROL = "#!/bin/bash\nprintf 'localhost\\nlocalhost\\n'\n"
SRUN = r"""#!/bin/bash
out=/dev/stdout
while [[ $1 == --* ]]; do [[ $1 == --output=* ]] && out=${1#--output=}; shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  file=${out//%x/$SLURM_JOB_NAME}; file=${file//%j/$SLURM_JOB_ID}; file=${file//%N/node$node}
  SLURM_NODEID=$node "$@" > "$file" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.slow
def test_the_slurm_script_stops_every_node_with_a_checkpoint_on_its_signal(tiny_data, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "logs").mkdir()
    run = tmp_path / "run"
    config = _dp2_tp2(tiny_data, run, 100_000)
    config["checkpoints"] |= {"checkpoint_interval": 100_000, "resume_checkpoint_path": "auto"}
    config_path = write_config(tmp_path / "config.yaml", config)
    # The script's rendezvous port is 20000 + SLURM_JOB_ID % 20000: pick a job id whose port is free.
    job_id = next(j for j in random.sample(range(1, 20000), 100) if _port_is_free(20000 + j))
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "train", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_CPUS_ON_NODE": "2", "SLURM_GPUS_ON_NODE": "2"}
    batch_log = tmp_path / "logs" / f"train-{job_id}.out"
    with open(batch_log, "w") as out:
        batch = subprocess.Popen(["bash", str(ROOT / "examples/slurm/train.sbatch"), str(config_path)],
                                 cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT_S
    with killed_on_failure([batch]):
        while not ((run / "metrics.jsonl").exists() and len(metrics(run)) >= 3):
            assert batch.poll() is None, batch_log.read_text()[-4000:]
            assert time.monotonic() < deadline, "no training steps"
            time.sleep(0.2)
        # What --signal=USR1@120 does: every process of the job step gets it (the agents and their workers); not
        # the batch shell, nor srun, which runs in the batch step.
        _srun, *step_processes = descendants(batch.pid)
        signal_all(step_processes, signal.SIGUSR1)
    try:
        wait_for_all([batch], [batch_log], TIMEOUT_S)
    finally:
        _kill_orphans(step_processes, str(config_path))

    step = checkpoint_json(run)["step"]
    assert metrics(run)[-1]["step"] == step >= 3
    stops = 0
    for node in range(2):
        log = (tmp_path / "logs" / f"train-{job_id}-node{node}.out").read_text()
        stops += log.count(f"SIGUSR1 received: stopped after step {step} with a checkpoint")
    assert stops == 4, "every rank of both nodes stops after the same step"
