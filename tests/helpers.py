"""Helpers shared by the test files (plain functions and constants; the fixtures are in ``conftest.py``): the test
tiers, the tiny corpus and its configs, running the CLI in this process, training runs in subprocesses with their
process trees, what the layout-parity tests compare, and the kernel checks run both on the CPU (through Triton's
interpreter) and on a GPU. A test file imports from here (and runs functions on several gloo ranks with
``distributed.py``), never from another test file."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from nanotron.config import LlamaConfig
from nanotron.models.llama.model import LlamaForCausalLM
from nanotron.nn.recompute import ATTENTION_OPS, compile_layer, recompute_in_backward

ROOT = Path(__file__).resolve().parents[1]
TIER_VARIABLE = "NANOTRON_TEST_TIER"
TIERS = ("quick", "default", "full")
FULL_TIER_REASON = f"full tier only; run it with {TIER_VARIABLE}=full bash scripts/run_tests.sh"


def tier_name() -> str:
    """``quick``, ``default`` or ``full``, from the environment (unset or empty means ``default``)."""
    tier = os.environ.get(TIER_VARIABLE, "").strip().lower() or "default"
    if tier not in TIERS:
        raise pytest.UsageError(f"{TIER_VARIABLE}={os.environ[TIER_VARIABLE]!r}: expected one of {', '.join(TIERS)}")
    return tier


def full_tier() -> bool:
    return tier_name() == "full"


def quick_tier() -> bool:
    return tier_name() == "quick"


def parity_steps(short: int = 6, full: int = 20) -> int:
    """Training steps of a layout-parity run: ``full`` under NANOTRON_TEST_TIER=full, ``short`` otherwise."""
    return full if full_tier() else short


def assert_reference_trains(metrics: list[dict], steps: int) -> None:
    """The single-process reference really learns, so that matching it means something: one record per step, every
    grad-norm positive, and the last step's loss clearly below the first's. The tiny models start near
    ln(384) = 5.95 and lose about 1.0 nat in 6 steps and 2.2 in 16 to 20 (measured): the bar is 0.75 in the short
    runs and 1.0 in the full tier's."""
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["grad_norm"] > 0 for m in metrics), [m["grad_norm"] for m in metrics]
    margin = 1.0 if steps >= 16 else 0.75
    first, last = metrics[0]["lm_loss"], metrics[-1]["lm_loss"]
    assert last < first - margin, f"loss {first:.3f} -> {last:.3f} over {steps} steps: no drop > {margin}"


WORDS = (
    "the a one every small large red green blue old new quick slow cat dog bird fish tree river stone house "
    "runs jumps sleeps eats sees finds makes takes near under over behind with without and but then so"
).split()


def run_with_triton_interpreter(code: str) -> None:
    """Run ``code`` in a fresh Python with Triton's interpreter on (it is chosen when Triton is imported), the tests
    folder importable: how the CPU checks the GPU's Triton kernels against their plain-torch references. On a GPU
    host the CUDA tests check the kernels themselves, and the interpreter is not run: torch 2.11's ``wrap_triton``
    refuses the interpreter's kernels, so every such check failed there."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the kernels themselves (tests/test_cuda_kernels.py and the CUDA tests beside this one)")
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); {code}"
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def write_corpus(folder: Path, documents: int = 400, seed: int = 0) -> Path:
    """JSONL of simple, repetitive sentences: enough structure for a tiny model to learn within a few steps."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    lines = []
    for i in range(documents):
        sentences = [
            " ".join(rng.choice(WORDS[:16]) for _ in range(2)) + " " + rng.choice(WORDS[16:26]) + " "
            + rng.choice(WORDS[26:34]) + " the " + rng.choice(WORDS[16:26]) + "."
            for _ in range(rng.randint(3, 8))
        ]
        lines.append(json.dumps({"id": str(i), "text": " ".join(sentences)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_config_dict(tiny_data: dict[str, Path], checkpoint_dir: Path, **overrides) -> dict:
    """A complete config for a ~0.2M-parameter Llama on the tiny corpus; ``overrides`` patch sections."""
    config = {
        "general": {"project": "tests", "run": "tiny", "seed": 7},
        "checkpoints": {"checkpoints_path": str(checkpoint_dir), "checkpoint_interval": 1000},
        "parallelism": {"dp": 1, "pp": 1, "tp": 1},
        "model": {
            "dtype": "float32",
            "init_method": {"std": 0.02},
            "model_config": {
                "is_llama_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "tie_word_embeddings": True,
            },
        },
        "tokenizer": {"tokenizer_name_or_path": str(tiny_data["tokenizer"])},
        "tokens": {"sequence_length": 32, "micro_batch_size": 4, "batch_accumulation_per_replica": 2,
                   "train_steps": 20},
        "optimizer": {
            "weight_decay": 0.01, "clip_grad": 1.0,
            "learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 4, "min_decay_lr": 3e-4},
        },
        "data_stages": [{"name": "main", "start_training_step": 1,
                         "data": {"seed": 3, "num_loading_workers": 0,
                                  "dataset": {"dataset_folder": [str(tiny_data["tokenized"])]}}}],
        "logging": {"iteration_step_info_interval": 1},
    }
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    return config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_json(run: Path) -> dict:
    return json.loads((run / (run / "latest.txt").read_text().strip() / "checkpoint.json").read_text())


def start_training(config_path: Path, launcher: list[str], log: Path | None = None) -> subprocess.Popen:
    """Start a training run; its output goes to ``log`` (a file: a pipe nobody reads while the test waits would
    stall the run once full)."""
    env = {**os.environ, "NANOTRON_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    with open(log or os.devnull, "w") as output:
        return subprocess.Popen(launcher + [str(ROOT / "run_train.py"), "--config-file", str(config_path)],
                                stdout=output, stderr=subprocess.STDOUT, text=True, env=env)


def children(pid: int) -> list[int]:
    listing = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in listing.split()]


def descendants(pid: int) -> list[int]:
    """Every process started by ``pid``, depth first (a child, then what it started)."""
    return [d for child in children(pid) for d in (child, *descendants(child))]


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def kill_with_descendants(processes: list[subprocess.Popen]) -> None:
    """Those still running, with everything they started: torchrun's workers run in sessions of their own and
    would outlive their agent (or the script that started it) if only that were killed."""
    for process in processes:
        if process.poll() is None:
            signal_all([*descendants(process.pid), process.pid], signal.SIGKILL)
            process.wait()


def wait_for_all(processes: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    """Every process exits 0; as soon as one fails (or the time is up) the others are stopped, not waited for."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in processes) and not any(p.poll() for p in processes):
            assert time.monotonic() < deadline, f"still running after {timeout_s} s"
            time.sleep(0.2)
    finally:
        kill_with_descendants(processes)
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log.read_text()[-4000:]


def away_from_initial_values(model: torch.nn.Module) -> torch.nn.Module:
    """Norms away from 1 and biases away from 0 (where transformers starts them), so that a lost tensor would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model


def transformers_outputs(hf: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """A saved transformers model's logits over the first prompt and its greedy continuations of every prompt."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0]
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return {"logits": logits, "greedy": greedy}


def benchmark_on_cpu(monkeypatch, benchmark) -> None:
    """``scripts/benchmark.py`` (the module ``benchmark``) with CUDA's memory counters, its all-gather and its CUDA
    event timer stood in, so that ``run_nanotron`` trains the real trainer on the CPU: every step takes 0.5 s."""
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(benchmark, "per_rank", lambda value: [value])
    monkeypatch.setattr(benchmark, "timed", lambda step, steps, warmup: ([step(i) or 0.5 for i in range(warmup + steps)]
                                                                          [warmup:], 0))


@contextlib.contextmanager
def killed_on_failure(processes: list[subprocess.Popen]):
    try:
        yield
    except BaseException:
        kill_with_descendants(processes)
        raise


def finished(process: subprocess.Popen, log: Path, timeout_s: float) -> Outcome:
    """The exit status and output (``log``, all in ``stderr``) of ``process`` once it ends; one still running after
    ``timeout_s`` fails the test (inside ``killed_on_failure``, which then stops it with everything it started)."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout_s} s:\n{log.read_text()[-4000:]}")
    return Outcome(process.returncode, "", log.read_text())


def training_outcome(config_path: Path, launcher: list[str], log: Path, timeout_s: float) -> Outcome:
    """A training run (``start_training``) to its end, within ``timeout_s`` (``finished``)."""
    process = start_training(config_path, launcher, log)
    with killed_on_failure([process]):
        return finished(process, log, timeout_s)


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, which only waits to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- The CLI in this process ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def cli(*args) -> Outcome:
    """``nanotron ARGS`` in this process; its exit status, stdout and stderr.

    Undoes what a command leaves behind in the process (the variables ParallelContext sets for a world of one, the
    ``nanotron`` log handler bound to the captured stream, a process group left by a failed start-up), so that
    every call starts as a fresh ``nanotron`` process would.
    """
    from nanotron.cli import main

    environment = dict(os.environ)
    logger = logging.getLogger("nanotron")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(arg) for arg in args])
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
    return Outcome(code, out.getvalue(), err.getvalue())


def assert_user_error(outcome: Outcome, *fragments: str) -> str:
    """Exit status 2, exactly one `error:` line containing every fragment, no traceback; returns the line."""
    assert outcome.code == 2, outcome.stderr[-3000:]
    assert len(outcome.error_lines) == 1, outcome.stderr[-3000:]
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    line = outcome.error_lines[0]
    for fragment in fragments:
        assert fragment in line, line
    return line


def train(config: dict, path: Path) -> Outcome:
    outcome = cli("train", "--config-file", write_config(path, config))
    assert outcome.code == 0, outcome.stderr[-3000:]
    return outcome


def _config(tiny_data, run: Path, train_steps: int, **overrides) -> dict:
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": train_steps}, **overrides)
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


# --- Layout parity: training at a layout, logical tensors rebuilt from every rank's pieces ----------------------------


def _train(config: dict) -> list[dict]:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    if not trainer.pc.rank == 0:
        return []
    return [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]


def tp_config(tiny_data, tmp_path, name: str, tp: int, mode: str, overlap: bool = False) -> dict:
    """8 heads / 4 kv heads so that tp=4 holds whole kv heads; everything splits evenly at tp 4."""
    base = tiny_config_dict(tiny_data, tmp_path / name)
    model = base["model"]
    model["model_config"] = model["model_config"] | {"num_attention_heads": 8, "num_key_value_heads": 4,
                                                     "intermediate_size": 128}
    return tiny_config_dict(tiny_data, tmp_path / name, model=model,
                            parallelism={"tp": tp, "tp_mode": mode, "tp_linear_async_communication": overlap},
                            tokens={"train_steps": parity_steps()})


def _pieces(tensors: dict[str, torch.Tensor], params: dict, coords: dict, sizes: dict) -> dict:
    """Every local tensor as (logical slices, values) pieces, so the parent can rebuild the logical tensor."""
    from nanotron.parallel.placement import get_placement

    out = {}
    for name, tensor in tensors.items():
        placement = get_placement(params[name])
        out[name] = (placement.logical_shape,
                     [(logical, tensor[local].detach().clone()) for local, logical in placement.boxes(coords, sizes)])
    return out


def first_step(trainer) -> list:
    """The micro-batches of the trainer's first step (on this rank), as its training loop reads them."""
    return trainer.loader(trainer.config.data_stages[0]).next_step()


def first_step_gradients(trainer) -> tuple[torch.Tensor, dict]:
    """Loss and gradient pieces of the first step's micro-batches, without updating the weights.

    The gradients stay in the buckets: call ``trainer.buckets.zero()`` before training on.
    """
    loss = trainer.program.run(first_step(trainer), step=1)["lm_loss"]
    grads = {name: trainer.buckets.gradient(name) for name in trainer.params}
    return loss, _pieces(grads, trainer.params, trainer.pc.coordinates, trainer.pc.sizes)


def _run(config: dict) -> dict:
    """Logits, loss and gradients of the first step (no update), then the config's training steps."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    pc, params = trainer.pc, trainer.params
    weights = _pieces(dict(params), params, pc.coordinates, pc.sizes)
    batch = first_step(trainer)[0]
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.input_ids)
    loss, grads = first_step_gradients(trainer)
    norm_grads = {n: trainer.buckets.gradient(n).clone() for n in params if "norm" in n}
    trainer.buckets.zero()

    trainer.train()
    metrics = []
    if pc.rank == 0:
        metrics = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    local_shapes = {n: tuple(p.shape) for n, p in params.items()}
    return {"weights": weights, "grads": grads, "logits": logits, "loss": loss.item(),
            "norm_grads": norm_grads, "metrics": metrics, "local_shapes": local_shapes}


def assemble(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Logical tensors rebuilt from every rank's pieces; each element must be written consistently."""
    full: dict[str, torch.Tensor] = {}
    for result in results:
        for name, (shape, pieces) in result[key].items():
            target = full.setdefault(name, torch.full(shape, float("nan")))
            for logical, values in pieces:
                region = target[logical]
                assert torch.isnan(region).all() or torch.equal(region, values), f"{name}: ranks disagree"
                region.copy_(values)
    for name, tensor in full.items():
        assert not torch.isnan(tensor).any(), f"{name} is not fully covered"
    return full


def check_against_reference(reference: dict, results: list[dict], tp: int, variant: tuple) -> None:
    # Each rank holds 1/tp of every matrix.
    assert results[1]["local_shapes"]["layers.0.attn.qkv_proj.weight"][0] == 128 // tp, variant
    assert results[1]["local_shapes"]["embed_tokens.weight"][0] == 384 // tp

    reference_weights = assemble([reference], "weights")
    for name, tensor in assemble(results, "weights").items():
        assert torch.equal(tensor, reference_weights[name]), f"initial {name} differs"

    logits = torch.cat([r["logits"] for r in results], dim=-1)
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-6)
    assert results[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5)

    reference_grads = assemble([reference], "grads")
    for name, grad in assemble(results, "grads").items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    for name in results[0]["norm_grads"]:  # replicated norm weights: same gradient on every TP rank
        for other in results[1:]:
            assert torch.equal(other["norm_grads"][name], results[0]["norm_grads"][name]), name

    for expected, got in zip(reference["metrics"], results[0]["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]


# --- Generation -------------------------------------------------------------------------------------------------------


PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 21], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


def _nanotron(ckpt: str, tp: int, pp: int) -> dict:
    from nanotron.generation.generate import SamplingArgs, forward_logits, generate, load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=tp, pp=pp))
    model, _ = load_model(Path(ckpt), pc)
    ids = torch.tensor([PROMPTS[0]])
    logits = forward_logits(model, pc, ids, None, None, None, last_only=False)
    vocab = model.config.vocab_size
    greedy = SamplingArgs("greedy")
    # 48 new tokens: the longest prompt (10) plus them stays inside the tiny models' 64 positions.
    cached = generate(model, pc, PROMPTS, 48, greedy, None, vocab, use_cache=True)
    uncached = generate(model, pc, PROMPTS, 48, greedy, None, vocab, use_cache=False)
    return {"logits": None if logits is None else logits[0, :, :vocab], "cached": cached, "uncached": uncached}


# --- Model families and DoReMi ----------------------------------------------------------------------------------------


MAMBA = {"is_mamba_config": True, "d_model": 64, "num_hidden_layers": 2, "vocab_size": 384,
         "ssm_cfg": {"d_state": 8, "d_conv": 4, "expand": 2}}

# Layer 0 dense, layers 1-2 mixtures of 4 experts, top-2: a pipeline split [1, 2] leaves stage 0 without experts.
MOE = {"is_llamoe_config": True, "num_hidden_layers": 3, "moe_num_experts": 4, "num_experts_per_tok": 2,
       "moe_first_dense_layers": 1, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}
MOE_GLOBAL_BATCH = 16


def moe_config(tiny_data, folder: Path, *, dp: int = 1, ep: int = 1, tp: int = 1, pp: int = 1, zero: int = 0,
               resume_from: Path | None = None, **model_changes) -> dict:
    base = tiny_config_dict(tiny_data, folder)
    llama = {k: v for k, v in base["model"]["model_config"].items() if k != "is_llama_config"}
    model = base["model"] | {"model_config": llama | MOE | model_changes}
    parallelism = {"dp": dp, "tp": tp, "pp": pp, "expert_parallel_size": ep, "tp_mode": "REDUCE_SCATTER"}
    if pp > 1:
        parallelism["pp_stage_layers"] = [1, 2]
    steps = parity_steps()  # saved halfway
    return tiny_config_dict(
        tiny_data, folder, model=model, parallelism=parallelism,
        tokens={"train_steps": steps, "micro_batch_size": 4,
                "batch_accumulation_per_replica": MOE_GLOBAL_BATCH // (4 * dp * ep)},
        optimizer=base["optimizer"] | {"zero_stage": zero},
        checkpoints={"checkpoint_interval": steps // 2, "save_final_state": False,
                     "resume_checkpoint_path": None if resume_from is None else str(resume_from)},
    )


DOMAINS = ("animals", "colours", "rivers")
DOREMI_STEPS = 6


def doremi_config(tiny_data, folders, run: Path, *, dp=1, tp=1, pp=1, accumulation=4, reference=None,
                  resume=None, steps=DOREMI_STEPS, **doremi) -> dict:
    config = tiny_config_dict(
        tiny_data, run, parallelism={"dp": dp, "tp": tp, "pp": pp},
        tokens={"train_steps": steps, "micro_batch_size": 8 // (dp * accumulation),
                "batch_accumulation_per_replica": accumulation},
        checkpoints={"checkpoint_interval": 3, "save_final_state": False,
                     "resume_checkpoint_path": None if resume is None else str(resume)},
        data_stages=[{"name": "main", "start_training_step": 1,
                      "data": {"seed": 3, "num_loading_workers": 0,
                               "dataset": {"dataset_folder": [str(f) for f in folders]}}}],
    )
    # A schedule that does not depend on train_steps, so that a run stopped at step 3 resumes onto the same one.
    config["optimizer"]["learning_rate_scheduler"] = {"learning_rate": 3e-3, "lr_warmup_steps": 1,
                                                      "lr_decay_steps": DOREMI_STEPS - 1, "min_decay_lr": 3e-4}
    config["doremi"] = {"step_size": 1.0, "smoothing_param": 1e-3, **doremi}
    if reference is not None:
        config["doremi"]["ref_model_resume_checkpoint_path"] = str(reference)
    return config


def require_gpu(capability: tuple[int, int], exact: bool = False) -> None:
    """Skip unless a GPU of this compute capability (or a later one, unless ``exact``) is here. Called in a test's
    body, never at import: the gloo ranks come from a forkserver that has queried CUDA (``nn/kernels.py`` does on
    import), and a rank importing a test module that asked for the capability on import failed there ("Cannot
    re-initialize CUDA in forked subprocess")."""
    here = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if here is None or here < capability or (exact and here != capability):
        pytest.skip(f"needs a GPU of compute capability {'' if exact else 'at least '}{capability[0]}.{capability[1]}")


# --- Kernel checks: the CPU runs them through Triton's interpreter, test_cuda_kernels.py on a GPU ---------------------


def check_swiglu_kernel(device: str = "cpu") -> None:
    """The fused backward's kernel against the reference, fp32 and bf16, on a width that is not a multiple of its
    block."""
    from nanotron.nn.swiglu import swiglu_backward_fused, swiglu_backward_reference

    generator = torch.Generator(device).manual_seed(0)
    gate_up = torch.randn(3, 37, 2 * 1000, device=device, generator=generator)
    grad = torch.randn(3, 37, 1000, device=device, generator=generator)
    torch.testing.assert_close(swiglu_backward_fused(gate_up, grad), swiglu_backward_reference(gate_up, grad),
                               rtol=1e-5, atol=1e-6)
    bf16 = gate_up.bfloat16(), grad.bfloat16()
    torch.testing.assert_close(swiglu_backward_fused(*bf16), swiglu_backward_reference(*bf16))


def check_cast_both_layouts(device: str = "cpu") -> None:
    """``quantize_both_layouts`` (the Triton kernel on CUDA, or under Triton's interpreter on the CPU) against the
    plain-torch cast, bit for bit, in both formats: on a shape that is not a multiple of the kernel's tile, with
    values beyond the format's range (saturated). Off CUDA the inputs are grid points of the format times a power of
    two, so that no rounding happens: the interpreter rounds some values at the top of a binade down a whole binade
    (31.49 to 16 in e5m2), so rounding is left to the CUDA run, where the values are random."""
    from nanotron.nn.fp8 import CAST_BLOCK_C, CAST_BLOCK_R, E4M3, E5M2, cast_both_layouts

    generator = torch.Generator().manual_seed(0)
    rows, columns = CAST_BLOCK_R + 7, CAST_BLOCK_C + 9
    for dtype in (E4M3, E5M2):
        finfo = torch.finfo(dtype)
        values = torch.randn(rows, columns, generator=generator) * 8
        if device == "cpu":
            values = values.to(dtype).float()  # grid points
        x = (values / 4).to(torch.bfloat16)
        x[0, 0], x[-1, -1] = finfo.max, -finfo.max  # four times the format's range at a scale of 4
        x = x.to(device)
        scale = torch.tensor(4.0, device=device)
        expected = (x.float() * scale).clamp(finfo.min, finfo.max).to(dtype)
        for record_amax in (True, False):
            out, out_t, amax = cast_both_layouts(x, scale, dtype, record_amax)
            assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), dtype
            assert torch.equal(out_t.view(torch.uint8), expected.t().contiguous().view(torch.uint8)), dtype
            assert amax.item() == (x.float().abs().max().item() if record_amax else 0)
            assert out[0, 0].float().item() == finfo.max


def check_chunked_scan(device: str = "cpu") -> None:
    """The chunked scan equals the loop, forward and every gradient, in fp32 and with bf16 activations, on shapes
    whose length and channels are not multiples of the kernels' blocks and a d_state that is not a power of 2; and
    token-by-token decoding with the carried state equals it over 256 tokens."""
    from nanotron.nn.selective_scan import BLOCK_D, BLOCK_T, chunked_selective_scan, selective_scan_reference

    generator = torch.Generator(device).manual_seed(0)
    for batch, length, channels, d_state in ((2, 2 * BLOCK_T + 5, BLOCK_D + 8, 16), (1, 3, 7, 5)):
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            def random(*shape, dtype=dtype):
                return torch.randn(*shape, device=device, generator=generator).to(dtype).requires_grad_()
            x, B, C = random(batch, length, channels), random(batch, length, d_state), random(batch, length, d_state)
            delta = torch.nn.functional.softplus(random(batch, length, channels, dtype=torch.float32)).detach()
            delta.requires_grad_()
            A = (-3 * torch.rand(channels, d_state, device=device, generator=generator)).requires_grad_()
            inputs = (x, delta, A, B, C)
            y, last = chunked_selective_scan(*inputs)
            reference, reference_last = selective_scan_reference(*inputs, torch.zeros(channels, device=device))
            assert y.dtype == dtype  # the kernels' output is rounded to the activations' dtype
            torch.testing.assert_close(y.float(), reference, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(last, reference_last, rtol=1e-5, atol=1e-5)
            upstream = torch.randn(y.shape, device=device, generator=generator).to(dtype)
            grads = torch.autograd.grad(y, inputs, upstream)
            expected = torch.autograd.grad(reference, inputs, upstream.float())
            for name, grad, want in zip(("x", "delta", "A", "B", "C"), grads, expected):
                assert grad.dtype == want.dtype, name
                error = (grad.float() - want.float()).abs().max() / want.float().abs().max()
                assert error < tolerance, (name, dtype, error.item())
    # Decoding one token at a time with the carried state (generation) gives the parallel scan's outputs.
    x, delta = (f(1, 256, 8, device=device, generator=generator) for f in (torch.randn, torch.rand))
    A = -torch.rand(8, 4, device=device, generator=generator)
    B, C = (torch.randn(1, 256, 4, device=device, generator=generator) for _ in range(2))
    parallel, _ = chunked_selective_scan(x, delta, A, B, C)
    state, steps = None, []
    for t in range(256):
        y, state = selective_scan_reference(x[:, t:t + 1], delta[:, t:t + 1], A, B[:, t:t + 1], C[:, t:t + 1],
                                            torch.zeros(8, device=device), state)
        steps.append(y)
    # 256 steps one at a time against the chunked order, exp against exp2: fp32 rounding, up to 4e-5 on H200.
    torch.testing.assert_close(torch.cat(steps, dim=1), parallel, rtol=1e-4, atol=1e-4)


def check_causal_conv(device: str = "cpu") -> None:
    """The conv + SiLU kernels equal the reference, forward and every gradient, in fp32 and bf16, with and without
    a bias, reading x as the first half of a wider tensor (as the mixer passes in_proj's output), on a length and a
    channel count that are not multiples of the kernels' blocks."""
    from nanotron.nn.causal_conv1d import BLOCK_C, BLOCK_T, causal_conv1d_silu_reference, conv_forward

    generator = torch.Generator(device).manual_seed(0)
    batch, length, channels = 2, BLOCK_T + 13, BLOCK_C + 5
    for bias in (True, False):
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):  # bf16: dpre is rounded to it
            def random(*shape, dtype=dtype):
                return torch.randn(*shape, device=device, generator=generator).to(dtype).requires_grad_()
            wide, weight = random(batch, length, 2 * channels), random(channels, 1, 4)
            inputs = [wide, weight] + ([random(channels)] if bias else [])
            x = wide[..., :channels]
            out = conv_forward(x, weight, inputs[2] if bias else None)  # the kernels on any device, not a dispatch
            reference = causal_conv1d_silu_reference(x, weight, inputs[2] if bias else None)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), reference.float(), rtol=tolerance, atol=tolerance)
            upstream = torch.randn(out.shape, device=device, generator=generator).to(dtype)
            grads = torch.autograd.grad(out, inputs, upstream)
            expected = torch.autograd.grad(reference, inputs, upstream)
            assert not grads[0][..., channels:].any()
            for name, grad, want in zip(("x", "weight", "bias"), grads, expected):
                assert grad.dtype == want.dtype, name
                error = (grad.float() - want.float()).abs().max() / want.float().abs().max()
                assert error < tolerance, (name, dtype, bias, error.item())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def check_compiled_passes(device: str) -> None:
    """The compiled passes give the plain ones' losses and gradients (bf16, a padded vocabulary, a chunk size that
    does not divide the tokens): run on CUDA by test_cuda_kernels.py, where the compiler writes Triton kernels."""
    from nanotron.parallel.linear_cross_entropy import ChunkPasses, linear_cross_entropy

    generator = torch.Generator(device).manual_seed(0)
    tokens, hidden_size, padded, vocab_size = 3000, 256, 5008, 5000
    hidden = torch.randn(tokens, hidden_size, device=device, generator=generator).bfloat16()
    weight = (torch.randn(padded, hidden_size, device=device, generator=generator) * 0.05).bfloat16()
    labels = torch.randint(0, vocab_size, (tokens,), device=device, generator=generator)
    mask = torch.rand(tokens, device=device, generator=generator) > 0.1
    initialized = dist.is_initialized()
    if not initialized:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for passes in (ChunkPasses(), ChunkPasses.compiled()):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss, losses, _ = linear_cross_entropy(h, w, labels, mask / mask.sum(), dist.group.WORLD, vocab_size,
                                                   1024, passes)
            loss.backward()
            results.append((loss, losses, h.grad, w.grad))
    finally:
        if not initialized:
            dist.destroy_process_group()
    for name, compiled, plain, tolerance in zip(("loss", "token losses", "grad hidden", "grad weight"), results[1],
                                                results[0], (1e-6, 1e-6, 2 ** -8, 2 ** -8)):
        assert compiled.dtype == plain.dtype, name
        assert relative_error(compiled, plain) < tolerance, name


def check_softmax_statistics_kernel(device: str = "cpu") -> None:
    """The fused loss's statistics kernel against the reference: fp32 and bf16 logits, blocks that split a row or
    cover it, padding columns, a rank holding none of the real columns, and targets on other ranks (label -1)."""
    from nanotron.parallel.linear_cross_entropy import softmax_statistics_fused, softmax_statistics_reference

    generator = torch.Generator(device).manual_seed(0)
    logits = torch.randn(37, 1000, device=device, generator=generator) * 4
    labels = torch.randint(0, 990, (37,), device=device, generator=generator)
    labels[::5] = -1
    for dtype in (torch.float32, torch.bfloat16):
        for valid_columns in (1000, 990, 0):
            for block in (128, 1024):
                z, local = logits.to(dtype), labels.clamp(max=max(valid_columns - 1, -1))
                fused = softmax_statistics_fused(z, local, valid_columns, block)
                expected = softmax_statistics_reference(z, local, valid_columns)
                torch.testing.assert_close(fused, expected, rtol=1e-6, atol=0, msg=f"{dtype} {valid_columns} {block}")


def without_id_ranges(metadata: dict) -> dict:
    """``metadata`` as a version of ``nanotron preprocess`` that recorded no id range would have written it."""
    return metadata | {"shards": [{key: value for key, value in shard.items()
                                   if key not in ("min_token_id", "max_token_id")} for shard in metadata["shards"]]}


# --- FP8 ---


def strict_scaled_mm(calls: list):
    """A stand-in for ``torch._scaled_mm`` that checks the demands every FP8 GPU makes (dimensions multiples of 16,
    a row-major, b column-major, scale shapes, and a bf16 output with per-row scales: Ada and sm_100+ GPUs refuse
    fp32 there) and multiplies as the emulation does; each call appends a's shape to ``calls``."""
    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
        calls.append(a.shape)
        assert all(d % 16 == 0 for d in (*a.shape, *b.shape)), (a.shape, b.shape)
        assert a.is_contiguous() and b.t().is_contiguous()
        assert scale_a.shape in ((), (a.shape[0], 1)) and scale_b.shape in ((), (1, b.shape[1]))
        assert not (scale_a.dim() or scale_b.dim()) or out_dtype == torch.bfloat16, f"rowwise with {out_dtype} out"
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    return scaled_mm


def train_fp8_model(config: dict) -> dict:
    """The FP8 linears and expert groups converted, their range counters, the metrics records (rank 0) and this
    rank's amax histories."""
    from nanotron.config import config_from_dict
    from nanotron.nn.fp8 import FP8Matmul, FP8RangeCounts
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    converted = sum(isinstance(getattr(m, "matmul", None), FP8Matmul) for m in trainer.model.modules())
    experts = sum(isinstance(getattr(m, "expert_matmul", None), FP8Matmul) for m in trainer.model.modules())
    counters = sum(isinstance(m, FP8RangeCounts) for m in trainer.model.modules())
    trainer.train()
    histories = {name: b.clone() for name, b in trainer.model.named_buffers() if name.endswith("fp8_amaxes.history")}
    records = []
    if trainer.pc.rank == 0:
        records = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    return {"converted": converted, "experts": experts, "counters": counters, "records": records,
            "histories": histories}


# --- Data as upstream users hold it -----------------------------------------------------------------------------------


def corpus_documents(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]


def datatrove_folder(folder: Path, documents: list[str], tokenizer: Path, **options) -> Path:
    """``documents`` tokenized by datatrove's DocumentTokenizer, as upstream users write their data (each followed by
    the end-of-document token unless ``eos_token=None``)."""
    pytest.importorskip("datatrove", reason='datatrove writes the .ds fixtures; pip install -e ".[test]"')
    from datatrove.data import Document
    from datatrove.pipeline.tokens import DocumentTokenizer

    options = {"eos_token": "<|endoftext|>"} | options
    step = DocumentTokenizer(output_folder=str(folder), tokenizer_name_or_path=str(tokenizer), **options)
    step.run(iter(Document(text=text, id=str(i)) for i, text in enumerate(documents)), rank=0, world_size=1)
    return folder


def first_step_then_train(config: dict) -> dict:
    """Loss and gradient pieces of the first step (no update), then the config's training steps, without the
    logits and weights of ``_run``. The process group stays for the next call of the same spawn."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    loss, grads = first_step_gradients(trainer)
    trainer.buckets.zero()
    trainer.train()
    metrics = []
    if trainer.pc.rank == 0:
        metrics = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    return {"loss": loss.item(), "grads": grads, "metrics": metrics, "sharded": trainer.buckets.buckets[0].sharded}


# --- Activation recomputation: training runs, and a small Llama's losses and gradients --------------------------------

RECOMPUTE_STEPS = 6


def recompute_config(tiny_data, folder, recompute: str, **parallelism) -> dict:
    parallelism = tiny_config_dict(tiny_data, folder)["parallelism"] | parallelism | {"recompute": recompute}
    return tiny_config_dict(tiny_data, folder, parallelism=parallelism, tokens={"train_steps": RECOMPUTE_STEPS},
                            checkpoints={"checkpoint_interval": 1000, "save_final_state": False})


def train_with_flops(config: dict) -> dict:
    """The run's metrics (on rank 0) and its model and hardware FLOPs per token."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    metrics = []
    if trainer.pc.rank == 0:
        metrics = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    flops = {"model_flops": trainer.flops_per_token, "hardware_flops": trainer.step_log.hardware_flops_per_token}
    return {"metrics": metrics, **flops}


SMALL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
BATCH, SEQ = 2, 16


class AttentionCalls(TorchDispatchMode):
    """Counts the attention kernels' forward ops that run (an op selective recomputation hands back from its cache
    in the backward never reaches this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def small_llama(config: LlamaConfig = SMALL, device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, config.vocab_size).to(device)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    return model


def recomputed(model: LlamaForCausalLM, recompute: str | None, compiled: bool = False) -> LlamaForCausalLM:
    model = copy.deepcopy(model)
    for layer in model.layers.values():
        if recompute is not None:
            recompute_in_backward(layer, recompute)
        if compiled:
            compile_layer(layer)
    return model


def loss_and_gradients(model, ids: torch.Tensor, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, **inputs).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def ids_for(config: LlamaConfig, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)


def assert_same_gradients(got: dict, expected: dict, atol: float, rtol: float = 0.0) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=atol, msg=name)
