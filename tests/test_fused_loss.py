"""The fused LM head + cross-entropy (``parallel/linear_cross_entropy.py``): against logits then ``F.cross_entropy``
at several chunk sizes, over vocabulary shards at tp=2 in both modes, in training against the unfused loss at
several layouts, and the bound on what it allocates; the unfused vocabulary-parallel cross-entropy reads nothing back
to the host."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from support.configs import tiny_config_dict
from support.distributed import run_distributed, run_distributed_each
from support.kernels import relative_error

HIDDEN, VOCAB, PADDED, BATCH, SEQUENCE = 8, 37, 40, 3, 16  # 48 tokens, 3 padding columns
TOKENS = BATCH * SEQUENCE


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process: the loss's tensor-parallel group at tp=1."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def inputs(dtype: torch.dtype = torch.float32, vocab_size: int = VOCAB) -> tuple[torch.Tensor, ...]:
    """Hidden states, the padded head weight, labels and the token weights of ``sum / count`` with about a quarter
    of the tokens masked, the whole second sequence among them (whole chunks of up to 16 tokens)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQUENCE, HIDDEN, generator=generator).to(dtype)
    weight = torch.randn(PADDED, HIDDEN, generator=generator).to(dtype)
    labels = torch.randint(0, vocab_size, (BATCH, SEQUENCE), generator=generator)
    mask = torch.rand(BATCH, SEQUENCE, generator=generator) > 0.25
    mask[1] = False
    return hidden, weight, labels, mask / mask.sum()


def reference(hidden, weight, labels, token_weights, vocab_size: int = VOCAB, compute=torch.float32):
    """The unfused loss: the logits in full (in ``compute``), then ``F.cross_entropy`` on the real columns."""
    hidden = hidden.detach().to(compute).requires_grad_()
    weight = weight.detach().to(compute).requires_grad_()
    logits = F.linear(hidden, weight)[..., :vocab_size]
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    loss = (token_weights * losses).sum()
    loss.backward()
    return loss, losses, hidden.grad, weight.grad


def fused(hidden, weight, labels, token_weights, group, chunk: int, vocab_size: int = VOCAB):
    from nanotron.parallel.linear_cross_entropy import linear_cross_entropy

    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, losses, _ = linear_cross_entropy(hidden, weight, labels, token_weights, group, vocab_size, chunk)
    assert not losses.requires_grad
    loss.backward()
    return loss, losses, hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 16, 20, TOKENS, 1000])
def test_equals_logits_then_cross_entropy_in_fp32(group, chunk):
    """Chunks that divide the 48 tokens or not, one chunk or one token each; masked tokens weigh nothing."""
    expected = reference(*inputs())
    got = fused(*inputs(), group, chunk)
    for name, actual, wanted in zip(("loss", "token losses", "grad hidden", "grad weight"), got, expected):
        assert actual.dtype == wanted.dtype, name
        assert relative_error(actual, wanted) < 1e-6, name
    assert torch.equal(got[3][VOCAB:], torch.zeros(PADDED - VOCAB, HIDDEN))  # padding rows get no gradient
    assert torch.equal(got[2][1], torch.zeros(SEQUENCE, HIDDEN))  # the masked sequence gets none either


@pytest.mark.slow
def test_the_compiled_passes_give_the_plain_ones_values():
    """Compiled on the CPU (as on CUDA by test_cuda_kernels.py): the chunk passes within rounding, and the sum of the
    chunks' head gradients and the backward's scaling bit for bit, the scaling in place."""
    from nanotron.parallel.linear_cross_entropy import ChunkPasses
    from support.kernels import check_compiled_passes

    check_compiled_passes("cpu")
    generator = torch.Generator().manual_seed(0)
    partials = [torch.randn(40, 24, generator=generator).bfloat16() for _ in range(3)]
    factor = torch.tensor(0.3)
    results = []
    for passes in (ChunkPasses(), ChunkPasses.compiled()):
        middle = passes.sum_in_fp32(partials[0], partials[1], torch.float32)
        total = passes.sum_in_fp32(middle, partials[2], torch.bfloat16)
        scaled = total.clone()
        assert passes.scale_(scaled, factor).data_ptr() == scaled.data_ptr()
        results.append((middle, total, scaled))
    exact = sum(partial.double() for partial in partials)
    assert results[0][1].dtype == torch.bfloat16 and torch.equal(results[0][1], exact.bfloat16())
    assert torch.equal(results[0][2], (exact.bfloat16().float() * 0.3).bfloat16())
    for plain, compiled in zip(*results):
        assert plain.dtype == compiled.dtype and torch.equal(plain, compiled)


@pytest.mark.slow
def test_the_statistics_kernel_equals_the_reference_under_triton_s_interpreter():
    from support.kernels import run_with_triton_interpreter

    run_with_triton_interpreter("from support.kernels import check_softmax_statistics_kernel as check; check()")


def test_bf16_is_within_bf16_rounding_of_the_fp32_reference(group):
    """bf16 logits and gradients: the fused loss is as close to the fp32 computation as the unfused bf16 one."""
    hidden, weight, labels, token_weights = inputs(torch.bfloat16)
    exact = reference(hidden, weight, labels, token_weights, compute=torch.float64)
    unfused = reference(hidden, weight, labels, token_weights, compute=torch.bfloat16)
    got = fused(hidden, weight, labels, token_weights, group, chunk=20)
    for name, actual, plain, wanted in zip(("loss", "token losses", "grad hidden", "grad weight"), got, unfused,
                                           exact):
        assert actual.dtype == plain.dtype, name
        assert relative_error(actual, wanted) < max(2 * relative_error(plain, wanted), 2 ** -8), name


def _sharded(chunk: int) -> list[dict]:
    """Every (mode, vocabulary size) through a column-parallel head at tp=2; with a vocabulary of 18 the second
    rank holds only padding columns."""
    from nanotron.layout import Axis, Group, Layout
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.linear_cross_entropy import LinearCrossEntropy
    from nanotron.parallel.tensor_parallel import ColumnParallelLinear

    pc = ParallelContext(Layout(tp=2))
    rank, group = pc.coord(Axis.TP), pc.group(Group.TP)
    results = []
    for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
        for vocab_size in (VOCAB, 18):
            hidden, weight, labels, token_weights = inputs(vocab_size=vocab_size)
            head = ColumnParallelLinear(HIDDEN, PADDED, group, mode)
            with torch.no_grad():
                head.weight.copy_(weight.chunk(2)[rank])
            x = hidden.chunk(2, dim=1)[rank] if mode == "REDUCE_SCATTER" else hidden
            x = x.clone().requires_grad_()
            loss, losses, _ = LinearCrossEntropy(group, vocab_size, chunk, compiled=False)(head, x, labels,
                                                                                          token_weights)
            loss.backward()
            results.append({"mode": mode, "vocab_size": vocab_size, "loss": loss.detach(), "losses": losses,
                            "grad_hidden": x.grad, "grad_weight": head.weight.grad})
    return results


def test_vocabulary_shards_at_tp_2_equal_tp_1_in_both_modes(group):
    by_rank = run_distributed(_sharded, 2, chunk=20)
    for ranks in zip(*by_rank):
        mode, vocab_size = ranks[0]["mode"], ranks[0]["vocab_size"]
        loss, losses, grad_hidden, grad_weight = fused(*inputs(vocab_size=vocab_size), group, 20, vocab_size)
        expected = reference(*inputs(vocab_size=vocab_size), vocab_size=vocab_size)
        for rank, got in enumerate(ranks):
            assert relative_error(got["loss"], loss) < 1e-6, (mode, vocab_size)
            assert relative_error(got["losses"], losses) < 1e-6, (mode, vocab_size)
            assert relative_error(got["losses"], expected[1]) < 1e-6, (mode, vocab_size)
            # Sequence-parallel: each rank's input is a sequence shard, and so is its gradient.
            wanted = grad_hidden.chunk(2, dim=1)[rank] if mode == "REDUCE_SCATTER" else grad_hidden
            assert relative_error(got["grad_hidden"], wanted) < 1e-6, (mode, vocab_size, rank)
        assert relative_error(torch.cat([r["grad_weight"] for r in ranks]), grad_weight) < 1e-6, (mode, vocab_size)
        assert relative_error(grad_weight, expected[3]) < 1e-6, (mode, vocab_size)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns while the mode is on (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


@pytest.mark.parametrize("chunk", [10, 20])
def test_no_tensor_spans_more_tokens_than_a_chunk(group, chunk):
    """Forward and backward never create a [tokens, vocab] tensor beyond one chunk (the shapes keep every other
    tensor smaller: hidden and weight-sized ones have fewer elements than a chunk of 10 tokens' logits)."""
    assert max(TOKENS * HIDDEN, PADDED * HIDDEN) < 10 * PADDED
    with LargestTensor() as unfused:
        reference(*inputs())
    assert unfused.largest == TOKENS * PADDED  # the probe sees the logits of the unfused loss
    with LargestTensor() as chunked:
        fused(*inputs(), group, chunk)
    assert chunked.largest == chunk * PADDED


# --- training: the fused loss against the unfused one ---------------------------------------------------------

STEPS = 4


def layout_config(tiny_data, folder, chunk: int, *, model: dict | None = None, model_config: dict | None = None,
                  **parallelism) -> dict:
    """The tiny Llama (or ``model_config``) at a layout; 2 micro-batches of 128 tokens per step, so chunks of 48
    tokens split each into 48, 48 and 32."""
    base = tiny_config_dict(tiny_data, folder)["model"]
    model = base | {"loss_chunk_tokens": chunk} | (model or {})
    if model_config is not None:
        model["model_config"] = model_config
    return tiny_config_dict(tiny_data, folder, model=model, parallelism=parallelism, tokens={"train_steps": STEPS})


def head_matmul(model) -> None:
    """A converter that gives the LM head another matmul (the same product, through another function)."""
    if model.lm_head is not None:
        model.lm_head.matmul = lambda x, weight, bias: x @ weight.t()


def _train(config: dict, converters: tuple = ()) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config), converters)
    fused_here = trainer.program.objective_at(1).language_model.head is not None
    trainer.train()
    metrics = []
    if trainer.pc.rank == 0:
        metrics = [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
    return {"fused": fused_here, "last_stage": trainer.pc.is_last_stage, "metrics": metrics}


def assert_same_steps(fused_ranks: list[dict], unfused_ranks: list[dict], what: str) -> None:
    """The fused run used the fused loss on its last stage, and logged the unfused run's losses and norms."""
    assert [r["fused"] for r in fused_ranks] == [r["last_stage"] for r in fused_ranks], what
    assert not any(r["fused"] for r in unfused_ranks), what
    fused_metrics, unfused_metrics = fused_ranks[0]["metrics"], unfused_ranks[0]["metrics"]
    assert len(fused_metrics) == len(unfused_metrics) == STEPS, what
    for got, expected in zip(fused_metrics, unfused_metrics):
        for key in ("lm_loss", "grad_norm") + tuple(k for k in expected if k.startswith("moe_") and "loss" in k):
            assert got[key] == pytest.approx(expected[key], rel=1e-5), (what, got["step"], key)


@pytest.mark.slow
def test_training_in_one_process_matches_the_unfused_loss(tiny_data, tmp_path):
    """The tied Llama, a mixture of experts (auxiliary losses) and Mamba, fused and not; and a head given
    another matmul, which keeps the unfused loss."""
    from support.configs import MAMBA, MOE

    llama = tiny_config_dict(tiny_data, tmp_path)["model"]["model_config"]
    families = {"llama": None, "llamoe": {k: v for k, v in llama.items() if k != "is_llama_config"} | MOE,
                "mamba": MAMBA}
    calls = [{"config": layout_config(tiny_data, tmp_path / f"{name}-{chunk}", chunk, model_config=model_config)}
             for name, model_config in families.items() for chunk in (48, 0)]
    calls.append({"config": layout_config(tiny_data, tmp_path / "converted", 48), "converters": (head_matmul,)})
    *results, converted = run_distributed_each(_train, 1, calls)
    for name, fused_run, unfused_run in zip(families, results[::2], results[1::2]):
        assert_same_steps(fused_run, unfused_run, name)
    assert_same_steps(results[0], converted, "a head with another matmul")


@pytest.mark.slow
def test_training_at_tp_2_and_pp_2_matches_the_unfused_loss(tiny_data, tmp_path):
    """Sequence-parallel TP with vocabulary padding (100 · tp = 200 divides 400: 16 padding columns on rank 1), and
    a pipeline of two stages with an untied head."""
    untied = tiny_config_dict(tiny_data, tmp_path)["model"]["model_config"] | {"tie_word_embeddings": False}
    layouts = {
        "tp=2 sequence parallel, padded vocabulary": {"tp": 2, "tp_mode": "REDUCE_SCATTER",
                                                      "model": {"make_vocab_size_divisible_by": 100}},
        "pp=2, untied head": {"pp": 2, "model_config": untied},
    }
    calls = [{"config": layout_config(tiny_data, tmp_path / f"{i}-{chunk}", chunk, **layout)}
             for i, layout in enumerate(layouts.values()) for chunk in (48, 0)]
    results = run_distributed_each(_train, 2, calls)
    for name, fused_run, unfused_run in zip(layouts, results[::2], results[1::2]):
        assert_same_steps(fused_run, unfused_run, name)


def test_a_negative_chunk_size_is_refused_naming_the_key(tiny_data, tmp_path):
    from nanotron.config import ConfigError, config_from_dict, validate_config

    config = layout_config(tiny_data, tmp_path, -1)
    with pytest.raises(ConfigError) as info:
        validate_config(config_from_dict(config), world_size=1)
    assert "model.loss_chunk_tokens must be >= 0 (got -1)" in info.value.problems


# --- the memory planner ----------------------------------------------------------------------------------------

def test_the_memory_planner_counts_the_kept_gradients_and_one_chunk():
    """The tiny example by hand (hidden 128, vocabulary 4096, fp32, micro-batch 16 x 128 = 2048 tokens): the fused
    loss keeps the gradients of the head's input and weight; its forward holds a chunk's logits and what its passes
    add, and from the second chunk on an fp32 weight-gradient sum. At the 1B shape it lowers the estimated peak."""
    from pathlib import Path

    from nanotron.config import load_config
    from nanotron.memory import estimate_memory, logits_bytes

    root = Path(__file__).resolve().parents[1]
    hidden, vocab, tokens, d = 128, 4096, 2048, 4
    kept = tokens * hidden * d + vocab * hidden * d

    def bytes_of(*overrides: str) -> tuple[int, int]:
        return logits_bytes(load_config(root / "examples" / "config_tiny_llama.yaml", list(overrides)), 16)

    assert bytes_of() == (kept, tokens * vocab * (d + 13))  # the default 4096 tokens: one chunk, eager
    chunk = 512 * vocab
    assert bytes_of("model.loss_chunk_tokens=512") == (kept, max(chunk * (d + 13) + 4 * vocab * hidden,
                                                                 chunk * d + vocab * hidden * (4 + 2 * d)))
    assert bytes_of("model.loss_chunk_tokens=512", "model.compile=true") == (
        kept, max(chunk * 2 * d + 4 * vocab * hidden, chunk * d + vocab * hidden * (4 + 2 * d)))

    def peak(chunk_tokens: int) -> float:
        config = load_config(root / "examples" / "config_llama1b_bench.yaml",
                             [f"model.loss_chunk_tokens={chunk_tokens}"])
        return estimate_memory(config, gpu_memory_gb=150.1).stages[0].peak / 1e9

    assert peak(4096) < peak(0) - 4  # the 4.2 GB of bf16 logits of 4 x 4096 tokens, and more


def _host_syncs_of_vocab_parallel_cross_entropy() -> int:
    """Forward and backward of the cross-entropy over a vocabulary of 10 padded to 12 (rank 1 holds the padding),
    counting the reads of tensor values to the host (``bool`` and ``item``) that it makes."""
    import torch.distributed as dist

    from nanotron.parallel.cross_entropy import vocab_parallel_token_losses

    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    logits = torch.randn(2, 5, 6, requires_grad=True)
    labels = torch.randint(0, 10, (2, 5))
    reads = []
    to_bool, item = torch.Tensor.__bool__, torch.Tensor.item
    torch.Tensor.__bool__ = lambda self: reads.append("bool") or to_bool(self)
    torch.Tensor.item = lambda self: reads.append("item") or item(self)
    try:
        losses = vocab_parallel_token_losses(logits, labels, dist.group.WORLD, vocab_size=10)
        losses.sum().backward()
    finally:
        torch.Tensor.__bool__, torch.Tensor.item = to_bool, item
    assert torch.isfinite(losses).all() and torch.isfinite(logits.grad).all()
    return len(reads)


def test_vocab_parallel_cross_entropy_reads_nothing_back_to_the_host():
    """Which columns are padding is known from the ranks' vocabulary slices: testing the mask's values made every
    rank wait for the GPU at every micro-batch."""
    assert run_distributed(_host_syncs_of_vocab_parallel_cross_entropy, 2) == [0, 0]
