"""FlashAttention-4 as nanotron runs it (``nn/flash_attention.py``), on the CPU: FA4's kernels replaced by a plain-torch
stand-in with FA4's calling convention, so that the custom ops, their fake implementations and autograd formula, the
translation of every mask into FA4's terms and the choice of kernel are checked against the SDPA reference. The
kernels themselves are compared with an fp32 reference on a GPU (``test_flash_attention_cuda.py``)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from nanotron.nn import flash_attention
from nanotron.nn.attention import AttentionMasks, FlashMask, attend
from support.configs import tiny_config_dict, write_config
from support.distributed import run_distributed
from support.parity import assemble, first_step_then_train
from support.runs import assert_user_error, cli, metrics, train_through_cli
from support.small_llama import (
    SMALL,
    AttentionCalls,
    assert_same_gradients,
    ids_for,
    loss_and_gradients,
    recomputed,
    small_llama,
)

DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
SEQUENCE = DOCUMENTS.shape[1]


def _sequences(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[torch.Tensor]:
    """FA4's sequences: the batch rows, or the varlen pieces of [tokens, heads, d] between ``cu_seqlens``."""
    if cu_seqlens is None:
        return list(x)
    bounds = cu_seqlens.tolist()
    return [x[start:end] for start, end in zip(bounds, bounds[1:])]


def _scores(q, k, window_left):
    """One sequence's scaled scores as FA4 defines causal attention, fp32 [heads, queries, keys]: [queries, heads, d]
    over [keys, kv_heads, d], the last query aligned with the last key, ``window_left`` more keys before each query's
    diagonal (None: all)."""
    queries, keys = q.shape[0], k.shape[0]
    diagonal = torch.arange(queries)[:, None] + keys - queries
    key = torch.arange(keys)[None, :]
    allowed = (key <= diagonal) & (key >= diagonal - (keys if window_left is None else window_left))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf"))


def _forward(q, k, v, window_left):
    scores = _scores(q, k, window_left)
    lse = scores.logsumexp(-1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).float()
    return torch.einsum("hqk,khd->qhd", (scores - lse[..., None]).exp(), v), lse


def _backward(q, k, v, out, dout, lse, window_left):
    """FlashAttention's backward from the saved output and log-sum-exp; kv heads sum their query heads'."""
    group = q.shape[1] // k.shape[1]
    p = (_scores(q, k, window_left) - lse[..., None]).exp()
    k_, v_ = (x.repeat_interleave(group, dim=1).float() for x in (k, v))
    dout = dout.float()
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    dp = torch.einsum("qhd,khd->hqk", dout, v_)
    ds = p * (dp - (dout * out.float()).sum(-1).T[..., None]) / q.shape[-1] ** 0.5
    dq = torch.einsum("hqk,khd->qhd", ds, k_)
    dk = torch.einsum("hqk,qhd->khd", ds, q.float())
    return dq, *(x.unflatten(1, (k.shape[1], group)).sum(2) for x in (dk, dv))


class StandIn:
    """FA4's ``_flash_attn_fwd`` and ``_flash_attn_bwd`` in plain torch (the arguments nanotron passes), counting
    the forward calls."""

    def __init__(self):
        self.calls = 0

    def forward(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                causal=False, window_size_left=None, window_size_right=None, return_lse=False, out=None, lse=None):
        assert causal and window_size_right in (None, 0) and return_lse
        assert (cu_seqlens_q is None) == (max_seqlen_q is None) and cu_seqlens_k is cu_seqlens_q
        self.calls += 1
        pieces = [_forward(*s, window_size_left) for s in zip(*(_sequences(x, cu_seqlens_q) for x in (q, k, v)))]
        outs, lses = zip(*pieces)
        out.copy_(torch.cat(outs) if cu_seqlens_q is not None else torch.stack(outs))
        lse.copy_(torch.cat(lses, dim=1) if cu_seqlens_q is not None else torch.stack(lses))
        return out, lse, None, None, None

    def backward(self, q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left=None,
                 window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 dq=None, dk=None, dv=None):
        assert softmax_scale is None and causal and softcap == 0.0
        lses = lse.split(torch.diff(cu_seqlens_q).tolist(), dim=1) if cu_seqlens_q is not None else list(lse)
        sequences = zip(*(_sequences(x, cu_seqlens_q) for x in (q, k, v, out, dout)), lses)
        grads = [_backward(*sequence, window_size_left) for sequence in sequences]
        for buffer, pieces in zip((dq, dk, dv), zip(*grads)):
            buffer.copy_(torch.cat(pieces) if cu_seqlens_q is not None else torch.stack(pieces))
        return dq, dk, dv


def _stand_in_kernels(kernels: StandIn) -> tuple[flash_attention.Kernels, None]:
    """The stand-in as loaded FA4 kernels that take every device, dtype and head dimension."""
    return flash_attention.Kernels(kernels.forward, kernels.backward, lambda device, dtype, head_dim: None), None


@pytest.fixture
def stand_in(monkeypatch) -> StandIn:
    """FA4 'installed' on this CPU."""
    kernels = StandIn()
    monkeypatch.setattr(flash_attention, "_loaded", _stand_in_kernels(kernels))
    monkeypatch.setattr(flash_attention, "_reported", set())
    return kernels


def _inputs(q_heads=4, kv_heads=2, queries=SEQUENCE, keys=SEQUENCE):
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, q_heads, queries, 8), (2, kv_heads, keys, 8), (2, kv_heads, keys, 8), (2, q_heads, queries, 8)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _attended(inputs, mask) -> list[torch.Tensor]:
    """The output and the gradients of q, k, v."""
    *leaves, grad = [x.clone().requires_grad_() for x in inputs]
    out = attend(*leaves, mask)
    out.backward(grad.detach())
    return [out.detach()] + [leaf.grad for leaf in leaves]


CASES = {  # name: (window, documents, query runs of a context-parallel rank of 2: chunks 0 and 3 of 4)
    "causal": (None, None, None), "window": (5, None, None), "documents": (None, DOCUMENTS, None),
    "documents and window": (4, DOCUMENTS, None), "cp chunks": (None, None, ((0, 4), (12, 4))),
    "cp chunks with a window": (3, None, ((0, 4), (12, 4))),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_fa4_runs_every_case_it_expresses_as_the_sdpa_reference(stand_in, case, heads):
    window, documents, runs = CASES[case]
    if runs is None:
        masks = [AttentionMasks.of_sequence(SEQUENCE, torch.device("cpu"), documents=documents, flash=flash)
                 for flash in (True, False)]
    else:
        rows = torch.cat([torch.arange(first, first + length) for first, length in runs])
        masks = [AttentionMasks(rows, torch.arange(SEQUENCE), query_runs=runs, flash=flash) for flash in (True, False)]
    flash_mask, reference_mask = (m.for_window(window) for m in masks)
    assert isinstance(flash_mask, FlashMask) and not isinstance(reference_mask, FlashMask)
    inputs = _inputs(*heads, queries=SEQUENCE if runs is None else 8)
    for got, expected in zip(_attended(inputs, flash_mask), _attended(inputs, reference_mask)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert stand_in.calls == (1 if runs is None else len(runs))


def test_document_boundaries_are_each_rows_documents_end_to_end():
    assert flash_attention.document_boundaries(DOCUMENTS).tolist() == [0, 5, 12, 16, 25, 32]
    assert flash_attention.document_boundaries(DOCUMENTS).dtype == torch.int32
    assert flash_attention.document_boundaries(torch.zeros(3, 4, dtype=torch.long)).tolist() == [0, 4, 8, 12]


@pytest.mark.parametrize("case", ["padded prompts", "queries after a KV cache", "documents under context"])
def test_cases_fa4_does_not_express_run_torchs_kernels_named_once(stand_in, caplog, case):
    cpu = torch.device("cpu")
    masks = {"padded prompts": lambda: AttentionMasks.of_sequence(
                 4, cpu, padding=torch.ones(2, 1, 4, 4, dtype=torch.bool), flash=True),
             "queries after a KV cache": lambda: AttentionMasks.of_sequence(1, cpu, past=3, flash=True),
             "documents under context": lambda: AttentionMasks(
                 torch.arange(2), torch.arange(4), DOCUMENTS[:, :2], DOCUMENTS[:, :4], query_runs=((0, 2),),
                 flash=True)}[case]
    with caplog.at_level(logging.WARNING, logger="nanotron.nn.flash_attention"):
        for window in (None, 2):
            for _ in range(2):
                assert isinstance(masks().for_window(window), torch.Tensor)  # the dense mask, on this CPU
    assert len(caplog.records) == 1 and case in caplog.records[0].getMessage()
    assert "not FlashAttention-4" in caplog.records[0].getMessage()


def test_auto_picks_fa4_where_it_runs_and_names_a_fallback_on_cuda_once(stand_in, caplog, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert flash_attention.use_flash_attention("auto", cpu, torch.float32, 8)
    assert flash_attention.use_flash_attention("fa4", cpu, torch.float32, 8)
    assert not flash_attention.use_flash_attention("torch", cpu, torch.float32, 8)
    monkeypatch.setattr(flash_attention, "_loaded", (None, "flash_attn.cute did not import (ModuleNotFoundError)"))
    assert not flash_attention.use_flash_attention("auto", cpu, torch.bfloat16, 64)  # a CPU: nothing to report
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="nanotron.nn.flash_attention"):
        for _ in range(2):
            assert not flash_attention.use_flash_attention("auto", cuda, torch.bfloat16, 64)
    assert len(caplog.records) == 1
    assert "ModuleNotFoundError" in caplog.records[0].getMessage() and "nanotron[fa4]" in caplog.records[0].getMessage()


@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["causal", "documents"])
@pytest.mark.slow
def test_a_compiled_layer_keeps_fa4_in_one_graph_with_the_same_gradients(stand_in, documents):
    eager, flash = small_llama(), small_llama()
    flash.flash_attention = True
    ids = ids_for(SMALL)
    inputs = {} if documents is None else {"document_ids": documents}
    expected_loss, expected = loss_and_gradients(eager, ids, **inputs)
    for layer in flash.layers.values():  # whole graphs or an error: no graph break around the custom op
        layer.compile(backend="aot_eager", fullgraph=True)
    loss, got = loss_and_gradients(flash, ids, **inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_same_gradients(got, expected, atol=1e-5)
    assert stand_in.calls == SMALL.num_hidden_layers


@pytest.mark.parametrize("granularity", ["selective", "pointwise"])
def test_selective_recompute_keeps_fa4s_output_instead_of_running_it_again(stand_in, granularity):
    model = small_llama()
    model.flash_attention = True
    expected_loss, expected = loss_and_gradients(model, ids_for(SMALL))
    model = recomputed(model, granularity)
    stand_in.calls = 0
    calls = AttentionCalls()
    with calls:
        loss, got = loss_and_gradients(model, ids_for(SMALL))
    assert calls.count == stand_in.calls == SMALL.num_hidden_layers  # the forward's; the backward ran none
    torch.testing.assert_close(loss, expected_loss)
    assert_same_gradients(got, expected, atol=1e-6)


def _tiny_qwen2(tiny_data, run, backend: str) -> dict:
    """A Qwen2 of sliding and full layers trained on packed documents, ``backend``'s attention."""
    model = {"model_config": {"is_qwen2_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "max_position_embeddings": 64, "tie_word_embeddings": True, "sliding_window_size": 6,
                              "no_rope_layer": 2, "_use_doc_masking": True},
             "attention_backend": backend}
    config = tiny_config_dict(tiny_data, run, model=tiny_config_dict(tiny_data, run)["model"] | model,
                              tokens={"sequence_length": 32, "micro_batch_size": 2, "batch_accumulation_per_replica": 1,
                                      "train_steps": 3})
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


@pytest.mark.slow
def test_training_through_fa4_matches_torchs_kernels(stand_in, tiny_data, tmp_path):
    runs = {backend: tmp_path / backend for backend in ("fa4", "torch")}
    for backend, run in runs.items():
        train_through_cli(_tiny_qwen2(tiny_data, run, backend), tmp_path / f"{backend}.yaml")
    losses = {backend: [m["lm_loss"] for m in metrics(run)] for backend, run in runs.items()}
    assert losses["fa4"] == pytest.approx(losses["torch"], rel=1e-5)
    assert stand_in.calls >= 3 * 2  # every layer of every step ran FA4's op


def _first_step_through_the_stand_in(config: dict) -> dict:
    """``first_step_then_train`` in a rank of its own, FA4 'installed' there; and how often it ran."""
    kernels = StandIn()
    flash_attention._loaded = _stand_in_kernels(kernels)
    return first_step_then_train(config) | {"fa4_calls": kernels.calls}


@pytest.mark.slow
def test_context_parallel_ranks_through_fa4_train_as_one_rank_of_torchs_kernels(tiny_data, tmp_path):
    """Each cp rank's two chunks of queries against the gathered keys, a sliding layer and a full one."""
    def config(run: str, backend: str, cp: int) -> dict:
        config = _tiny_qwen2(tiny_data, tmp_path / run, backend)
        config["model"]["model_config"]["_use_doc_masking"] = False
        return config | {"parallelism": config["parallelism"] | {"context_parallel_size": cp}}

    (reference,) = run_distributed(first_step_then_train, 1, config=config("one", "torch", 1))
    ranks = run_distributed(_first_step_through_the_stand_in, 2, config=config("cp2", "fa4", 2))
    assert all(rank["fa4_calls"] >= 2 * 2 * 2 for rank in ranks)  # two chunks, two layers, forward of each step
    assert ranks[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    expected = assemble([reference], "grads")
    for name, grad in assemble(ranks, "grads").items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    assert [m["lm_loss"] for m in ranks[0]["metrics"]] == pytest.approx([m["lm_loss"] for m in reference["metrics"]],
                                                                        rel=1e-5)


def test_asking_for_fa4_where_it_cannot_run_is_one_config_error(tiny_data, tmp_path):
    config = _tiny_qwen2(tiny_data, tmp_path / "run", "fa4")
    message = assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)),
                                "model.attention_backend: fa4")
    assert "FA4 runs on CUDA devices, this is cpu" in message and "nanotron[fa4]" in message


def test_a_misspelt_backend_is_refused_naming_the_key(tiny_data, tmp_path):
    config = _tiny_qwen2(tiny_data, tmp_path / "run", "flash")
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, "model.attention_backend", "fa4")


def test_plain_causal_sdpa_is_untouched_without_fa4():
    mask = AttentionMasks.of_sequence(SEQUENCE, torch.device("cpu")).for_window(None)
    assert mask is None
    q, k, v, _ = _inputs()
    torch.testing.assert_close(attend(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                      enable_gqa=True))
