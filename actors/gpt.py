"""A small GPT-style language model as a flat list of layers that can be cut anywhere.

Layer 0 embeds tokens and positions, layers ``1 .. n_blocks`` are pre-norm transformer
blocks, the last layer is the final norm and the vocabulary head. Every layer maps one
tensor to one tensor (``[batch, seq] tokens -> [batch, seq, d_model] -> ... -> [batch,
seq, vocab] logits``), so any contiguous slice is a pipeline piece.

Layer ``i`` is initialised from its own seed (``seed * 1009 + i``), so the same model
comes out whether it is built whole or a slice at a time on different stages. Its
state (parameters and its own optimizer's state) is kept per layer, so a checkpoint
can be re-split over any number of stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab: int = 96
    """Vocabulary size (byte-level text uses the printable characters)."""
    seq_len: int = 64
    """Tokens per sequence."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads (divides d_model)."""
    n_blocks: int = 4
    """Transformer blocks."""
    seed: int = 0
    """Seed of the initial weights."""

    @property
    def n_layers(self) -> int:
        return self.n_blocks + 2


class Embed(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] int64 -> [B, T, D]
        t = tokens.shape[1]
        return self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_heads = c.n_heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(c.d_model)
        self.lm = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, V]
        return self.lm(self.ln(x))


def build_layer(c: GPTConfig, i: int) -> nn.Module:
    """Layer ``i`` of the model, initialised from its own seed."""
    if not 0 <= i < c.n_layers:
        raise ValueError(f"layer {i} is outside the model's {c.n_layers} layers (0..{c.n_layers - 1})")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(c.seed * 1009 + i)
    try:
        if i == 0:
            return Embed(c)
        if i == c.n_layers - 1:
            return Head(c)
        return Block(c)
    finally:
        torch.random.set_rng_state(gen_state)


def build_layers(c: GPTConfig, indices: Sequence[int] | None = None) -> list[nn.Module]:
    return [build_layer(c, i) for i in (range(c.n_layers) if indices is None else indices)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_optimizer(layer: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """One AdamW per layer, so optimizer state travels with its layer when stages re-split."""
    return torch.optim.AdamW(layer.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


def layer_state(layer: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """One layer's parameters (and optimizer state) as tensors and plain data, on the CPU."""
    out: dict[str, Any] = {"params": {k: v.detach().cpu().clone() for k, v in layer.state_dict().items()}}
    if opt is not None:
        sd = opt.state_dict()
        out["opt"] = {
            "state": {str(k): {n: (t.detach().cpu().clone() if torch.is_tensor(t) else t) for n, t in s.items()} for k, s in sd["state"].items()},
            "groups": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]],
        }
    return out


def load_layer_state(layer: nn.Module, opt: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    device = next(layer.parameters()).device
    layer.load_state_dict({k: torch.as_tensor(v) for k, v in state["params"].items()})
    if opt is not None and "opt" in state:
        o = state["opt"]
        groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in o["groups"]]
        opt.load_state_dict({"state": {int(k): {n: (torch.as_tensor(t).to(device) if n != "step" else torch.as_tensor(t)) for n, t in s.items()} for k, s in o["state"].items()}, "param_groups": groups})


def measure_costs(c: GPTConfig, batch: int, layers: Sequence[nn.Module] | None = None, *, repeats: int = 3) -> list[float]:
    """Seconds of forward plus backward per layer for one micro-batch of ``batch`` sequences
    on this process (median of ``repeats``); what the layer split weighs layers by.
    ``layers``: a model of the user's own (token ids of ``c.vocab`` and ``c.seq_len`` in);
    the built-in model of ``c``'s shape when None."""
    layers = build_layers(c) if layers is None else layers
    x: torch.Tensor = torch.randint(0, c.vocab, (batch, c.seq_len))
    out = []
    for i, layer in enumerate(layers):
        times = []
        for _ in range(repeats + 1):  # the first run warms the allocator up
            inp = x if i == 0 else x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            y = layer(inp)
            y.float().pow(2).mean().backward()
            times.append(time.perf_counter() - t0)
        out.append(sorted(times[1:])[len(times[1:]) // 2])
        with torch.no_grad():
            x = layer(x)
    return out


def param_count(c: GPTConfig) -> int:
    return sum(p.numel() for layer in build_layers(c) for p in layer.parameters())


def check(c: GPTConfig) -> None:
    """Refuse shapes the model cannot take, naming the value and what would work."""
    if c.d_model % c.n_heads:
        ok = [h for h in range(1, min(c.d_model, 16) + 1) if c.d_model % h == 0]
        raise ValueError(f"n_heads={c.n_heads} does not divide d_model={c.d_model}; valid n_heads: {ok}")
    for key in ("vocab", "seq_len", "d_model", "n_heads", "n_blocks"):
        if getattr(c, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(c, key)}")
