"""A language model of the user's own for the pipeline: layers from a factory named by import path.

The contract: ``factory(spec) -> (layers, loss)``, where ``spec`` has ``vocab`` and
``seq_len``, ``layers`` is the model as an ordered list of ``torch.nn.Module`` (the first
takes token ids ``[B, T]`` int64, each next one the previous one's output) and
``loss(output, targets [B, T]) -> scalar tensor``. The pipeline cuts the list into pieces by
measured cost, exactly as it cuts the built-in GPT (:func:`raylane.actors.gpt.build_layer`
is the built-in's own factory, layer by layer).

Every stage builds the whole list with the same seed and keeps the layers it holds, so
the stages start from one model; :func:`check` builds it once on the driver and runs a
batch through it before any actor starts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


class ModelFactoryError(ValueError):
    """A factory that does not give a usable pipeline model, with what it must return."""


@dataclass(frozen=True)
class LMSpec:
    """What a factory is told about the data."""

    vocab: int
    """Token ids are 0..vocab-1."""
    seq_len: int
    """Tokens per sequence."""


@dataclass(frozen=True)
class LayerFactory:
    """The user's factory and what it is called with. Small and picklable (the function
    travels by value when its module is not installed)."""

    fn: Callable[[LMSpec], Any]
    """``factory(spec) -> (layers, loss)``."""
    name: str
    """Its import path, for messages."""
    spec: LMSpec
    """Vocabulary and sequence length."""
    seed: int = 0
    """torch's seed while the factory builds, so every stage builds the same weights."""

    def _built(self) -> tuple[list[nn.Module], Callable[..., torch.Tensor]]:
        key = (self.name, self.spec, self.seed, id(self.fn))
        if key not in _BUILT:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                got = self.fn(self.spec)
            _BUILT[key] = _checked_shape(self.name, got)
        return _BUILT[key]

    def build(self) -> tuple[list[nn.Module], Callable[..., torch.Tensor]]:
        """Fresh copies of every layer (as initialised), and the loss."""
        layers, loss = self._built()
        return [copy.deepcopy(m) for m in layers], loss

    def layer(self, i: int) -> nn.Module:
        """A fresh copy of layer ``i`` as initialised."""
        layers = self._built()[0]
        if not 0 <= i < len(layers):
            raise ValueError(f"layer {i} is outside model {self.name!r}'s {len(layers)} layers (0..{len(layers) - 1})")
        return copy.deepcopy(layers[i])

    def loss(self) -> Callable[..., torch.Tensor]:
        return self._built()[1]

    @property
    def n_layers(self) -> int:
        return len(self._built()[0])


# Built once per process and copied per use: a stage (re)loads its layers at every
# re-split, and building a big model each time would cost more than the copy.
_BUILT: dict[tuple, tuple[list[nn.Module], Callable[..., torch.Tensor]]] = {}


def _checked_shape(name: str, got: Any) -> tuple[list[nn.Module], Callable[..., torch.Tensor]]:
    want = "it must return (layers, loss): an ordered list of torch.nn.Module and loss(output, targets) -> scalar tensor"
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise ModelFactoryError(f"model factory {name!r} returned {type(got).__name__}; {want}")
    layers, loss = got
    if isinstance(layers, nn.Sequential):
        layers = list(layers)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ModelFactoryError(f"model factory {name!r} returned layers of type {type(layers).__name__}; {want}")
    bad = [f"{i} ({type(m).__name__})" for i, m in enumerate(layers) if not isinstance(m, nn.Module)]
    if bad:
        raise ModelFactoryError(f"model factory {name!r}: layers {', '.join(bad[:5])} are not torch.nn.Module; {want}")
    if not callable(loss):
        raise ModelFactoryError(f"model factory {name!r} returned a loss of type {type(loss).__name__}, not a callable; {want}")
    return list(layers), loss


def check(factory: LayerFactory, batch: int = 2) -> int:
    """Build the model and run ``batch`` sequences of token ids through every layer and the
    loss; the number of layers. Raises :class:`ModelFactoryError` naming what failed."""
    layers, loss = factory.build()
    spec = factory.spec
    x: Any = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(layers):
        try:
            x = layer(x)
        except Exception as exc:  # noqa: BLE001 - the user's layer: say which and with what input
            raise ModelFactoryError(f"model factory {factory.name!r}: layer {i} ({type(layer).__name__}) failed on "
                                    f"{'token ids [B, T]' if i == 0 else 'the previous layer output'}: {type(exc).__name__}: {exc}") from None
        if not isinstance(x, torch.Tensor):
            raise ModelFactoryError(f"model factory {factory.name!r}: layer {i} returned {type(x).__name__}; a pipeline passes one tensor between layers")
    try:
        value = loss(x, targets)
    except Exception as exc:  # noqa: BLE001
        raise ModelFactoryError(f"model factory {factory.name!r}: loss(output {tuple(x.shape)}, targets {tuple(targets.shape)}) failed: {type(exc).__name__}: {exc}") from None
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and torch.isfinite(value).all()):
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) and value.numel() != 1 else repr(value)
        raise ModelFactoryError(f"model factory {factory.name!r}: loss returned {got}; it must be a finite scalar tensor")
    return len(layers)
