"""Hugging Face interop: tiny models of each family saved by ``transformers``, the prompts, nanotron's and
transformers' logits and greedy continuations of them, and models with norms and biases away from their initial
values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

LLAMA_SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
FAMILIES = {  # transformers class prefix and config arguments
    "llama": ("Llama", LLAMA_SHAPE),
    "qwen2": ("Qwen2", LLAMA_SHAPE | {"tie_word_embeddings": True}),
    "mixtral": ("Mixtral", LLAMA_SHAPE | {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mamba": ("Mamba", dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, state_size=8)),
}


def save_tiny_hf_model(family: str, folder: Path) -> Path:
    """A tiny model of a family of ``FAMILIES`` saved to ``folder`` by ``transformers``, norms away from 1."""
    transformers = pytest.importorskip("transformers")
    prefix, arguments = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(getattr(transformers, f"{prefix}Config")(**arguments))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 21], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


def nanotron_outputs(ckpt: str, tp: int, pp: int, ep: int = 1) -> dict:
    """A checkpoint's logits over the first prompt and its greedy continuations of every prompt, with and without
    the KV cache, on this rank of a tp x pp (x ep: every expert-parallel rank generating the same text) layout."""
    from nanotron.generation.generate import SamplingArgs, forward_logits, generate, load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=tp, pp=pp, ep=ep))
    model, _ = load_model(Path(ckpt), pc)
    ids = torch.tensor([PROMPTS[0]])
    logits = forward_logits(model, pc, ids, None, None, None, last_only=False)
    vocab = model.config.vocab_size
    greedy = SamplingArgs("greedy")
    # 48 new tokens: the longest prompt (10) plus them stays inside the tiny models' 64 positions.
    cached = generate(model, pc, PROMPTS, 48, greedy, None, vocab, use_cache=True)
    uncached = generate(model, pc, PROMPTS, 48, greedy, None, vocab, use_cache=False)
    return {"logits": None if logits is None else logits[0, :, :vocab], "cached": cached, "uncached": uncached}


def transformers_outputs(hf: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """A saved transformers model's logits over the first prompt and its greedy continuations of every prompt."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0]
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return {"logits": logits, "greedy": greedy}


def away_from_initial_values(model: torch.nn.Module) -> torch.nn.Module:
    """Norms away from 1 and biases away from 0 (where transformers starts them), so that a lost tensor would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model
