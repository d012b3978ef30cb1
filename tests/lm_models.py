"""Language models of a user's own for the pipeline tests, named by import path
(``lm_models:tiny_lm``): one good factory and three that break the contract."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] ids -> [B, T, d]
        return self.emb(tokens)


class Mix(nn.Module):
    """A residual MLP over each position."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_lm(spec):
    d = 16
    return [Embed(spec.vocab, d), Mix(d), Mix(d), nn.Linear(d, spec.vocab)], lm_loss


def not_a_list(spec):
    return nn.Linear(2, 2)


def mismatched(spec):
    return [Embed(spec.vocab, 8), nn.Linear(9, spec.vocab)], lm_loss


def vector_loss(spec):
    return [Embed(spec.vocab, 8), nn.Linear(8, spec.vocab)], lambda out, targets: out.mean(-1)
