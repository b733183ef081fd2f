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


def one_process_outputs(ckpt: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """A checkpoint's model loaded in this process (its decoder ``layers``), its logits over the first prompt and its
    greedy continuations of every prompt with and without the KV cache."""
    from nanotron.generation.generate import SamplingArgs, forward_logits, generate, load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=1))
    try:
        model, _ = load_model(ckpt, pc)
        vocab, greedy = model.config.vocab_size, SamplingArgs("greedy")
        logits = forward_logits(model, pc, torch.tensor([prompts[0]]), None, None, None, last_only=False)
        return {"layers": list(model.layers.values()), "logits": logits[0, :, :vocab],
                "cached": generate(model, pc, prompts, new_tokens, greedy, None, vocab, use_cache=True),
                "uncached": generate(model, pc, prompts, new_tokens, greedy, None, vocab, use_cache=False)}
    finally:
        pc.destroy()


def export_back_exactly(hf: Path, ckpt: Path, back: Path, prompt: list[int]) -> tuple:
    """``ckpt`` (converted from ``hf``) exported to ``back`` by ``nanotron convert``: the same tensors as ``hf`` bit for
    bit, the same configuration class, and transformers' logits of ``prompt`` equal from both folders. Returns both
    folders' transformers configs (original, exported) and the exported tensors, for the caller's own checks."""
    from safetensors.torch import load_file

    from support.runs import cli

    transformers = pytest.importorskip("transformers")
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", ckpt, "--save-path", back)
    assert outcome.code == 0, outcome.stderr[-3000:]
    original, exported = load_file(hf / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    before, after = (transformers.AutoConfig.from_pretrained(path) for path in (hf, back))
    assert type(after) is type(before)
    model, reference = (transformers.AutoModelForCausalLM.from_pretrained(path).eval() for path in (back, hf))
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([prompt])).logits, reference(torch.tensor([prompt])).logits)
    return before, after, exported


def convert_altered(stored: Path, folder: Path, config_changes: dict, drop: str | None = None):
    """``nanotron convert hf-to-nanotron`` of a copy of the transformers folder ``stored`` (into ``folder/hf``) whose
    config.json takes ``config_changes`` and whose weights lose the tensors named ``...drop``, saving to
    ``folder/out``; the CLI's outcome."""
    import json

    from safetensors.torch import load_file, save_file

    from support.runs import cli

    hf = folder / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(json.loads((stored / "config.json").read_text()) | config_changes))
    tensors = load_file(stored / "model.safetensors")
    save_file({name: tensor for name, tensor in tensors.items() if drop is None or not name.endswith(drop)},
              hf / "model.safetensors")
    return cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", folder / "out")
