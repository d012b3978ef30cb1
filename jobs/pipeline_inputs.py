"""What the pipeline job trains on and what it trains: tokens and the model.

Tokens: the generated corpus (the default), a ``.npy`` of token ids, or a UTF-8 text file
tokenised by bytes (ids 0..255), local or on any pyarrow filesystem (s3://, gs://, hdfs://).
The model: the built-in GPT, or the user's ``factory(spec) -> (layers, loss)`` named by
import path (:mod:`raylane.actors.lm_factory`). Both are read and checked on the driver
before Ray starts; a token id beyond the vocabulary, a file that is not UTF-8, or a factory
that does not build a usable model is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from raylane import budget
from raylane import config as cfg
from raylane.budget import Estimate, size
from raylane.arrays import load_npy
from raylane import imports
from raylane.actors import corpus, gpt
from raylane.actors.lm_factory import LayerFactory, LMSpec, ModelFactoryError, check
from raylane.actors.tabular_files import filesystem


@dataclass
class TokenData:
    """Where the tokens come from; without a path, text generated in the package."""

    path: str | None = None
    """A .npy file of token ids (any integer dtype, one dimension), or a UTF-8 text file
    tokenised by bytes; local or a pyarrow URI. null: generated text (96 byte-level tokens)."""
    format: Literal["auto", "npy", "text"] = "auto"
    """auto: .npy files are token ids, anything else is text."""
    vocab: int | None = cfg.field(None, ge=2)
    """Token ids are 0..vocab-1. null: the largest id + 1 for .npy, 256 for text, 96 for generated text."""


@dataclass(frozen=True)
class Tokens:
    """The tokens read, and what they are."""

    ids: np.ndarray
    """Every token id, int64, in order."""
    vocab: int
    """Ids are 0..vocab-1."""
    kind: str
    """``generated``, ``npy`` or ``text``."""


def token_memory(d: TokenData, *, text_chars: int) -> list[Estimate]:
    """What reading the tokens holds on the driver at its peak, for :mod:`raylane.budget`.
    Generated: text_chars x 24 bytes (21.6 measured: the lines, the text, its int64 ids and
    the train/validation split). A text file: its bytes x 18 (the bytes read, an int64 id
    per byte, the split). A .npy: its bytes x (2 + 16 / itemsize) (the bytes read, the
    array, its int64 copy, the split), the dtype from its header. A file whose size or
    header cannot be read is not estimated: :func:`load_tokens` then says what is wrong."""
    if d.path is None:
        return [Estimate(f"generated text: text_chars ({text_chars:,}) x 24 bytes", text_chars * 24, "text_chars")]
    fmt = d.format if d.format != "auto" else ("npy" if d.path.lower().endswith(".npy") else "text")
    try:
        fs, path = filesystem(d.path)
        nbytes = fs.get_file_info(path).size
        per = 18.0
        if fmt == "npy":
            with fs.open_input_file(path) as f:
                major, _ = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                per = 2 + 16 / max(1, read(f)[2].itemsize)
    except (OSError, ValueError, TypeError, EOFError):
        return []
    if nbytes is None:
        return []
    return [Estimate(f"data.path ({size(nbytes)}, {fmt}) x {per:g}", nbytes * per, "data.path's size")]


def load_tokens(d: TokenData, *, text_chars: int, seed: int) -> Tokens:
    """The tokens ``d`` names, checked (ids within the vocabulary)."""
    if d.path is None:
        ids = corpus.encode(corpus.generate(text_chars, seed))
        return Tokens(ids, _vocab(d, ids, corpus.VOCAB, "the generated text"), "generated")
    fmt = d.format if d.format != "auto" else ("npy" if d.path.lower().endswith(".npy") else "text")
    fs, path = filesystem(d.path)
    try:
        with fs.open_input_file(path) as f:
            raw = f.read()
    except (OSError, ValueError) as exc:
        raise ValueError(f"data.path: cannot read {d.path!r}: {exc}") from None
    if fmt == "npy":
        try:
            ids = load_npy(raw, f"data.path {d.path!r}")
        except ValueError as exc:
            raise ValueError(f"{exc} (data.path takes a .npy array of token ids; pickled arrays are refused)") from None
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"data.path {d.path!r} holds a {ids.dtype} array of shape {ids.shape}; token ids are one dimension of integers")
        ids = ids.astype(np.int64)
        if ids.size and ids.min() < 0:
            at = int(np.argmin(ids))
            raise ValueError(f"data.path {d.path!r}: token id {int(ids[at])} at position {at} is negative; ids are 0..vocab-1")
        return Tokens(ids, _vocab(d, ids, int(ids.max()) + 1 if ids.size else 2, repr(d.path)), "npy")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"data.path {d.path!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); give UTF-8 text, or token ids as a .npy file") from None
    ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    return Tokens(ids, _vocab(d, ids, 256, repr(d.path)), "text")


def _vocab(d: TokenData, ids: np.ndarray, default: int, what: str) -> int:
    vocab = d.vocab if d.vocab is not None else default
    if ids.size and int(ids.max()) >= vocab:
        at = int(np.argmax(ids))
        raise ValueError(f"data.vocab: token id {int(ids[at])} at position {at} of {what} is beyond vocab={vocab} (ids are 0..vocab-1); "
                         f"raise data.vocab to at least {int(ids.max()) + 1}")
    return vocab


def load_factory(path: str, *, vocab: int, seq_len: int, seed: int) -> tuple[LayerFactory, int]:
    """The user's model factory, built and run on a batch here; and its number of layers."""
    try:
        fn = imports.load_callable(path, "model factory", "factory(spec) -> (layers, loss)")
    except imports.ImportPathError as exc:
        raise ModelFactoryError(str(exc)) from None
    factory = LayerFactory(fn, path, LMSpec(vocab, seq_len), seed)
    return factory, check(factory)


def assemble(c: gpt.GPTConfig, layers: dict[str, Any], factory: LayerFactory | None = None) -> torch.nn.Sequential:
    """The whole model in this process from per-layer states (a checkpoint's ``layers``)."""
    mods = factory.build()[0] if factory is not None else gpt.build_layers(c)
    for i, m in enumerate(mods):
        gpt.load_layer_state(m, None, layers[str(i)])
    return torch.nn.Sequential(*mods).eval()


def greedy(model: torch.nn.Module, c: gpt.GPTConfig, prompt: np.ndarray, n: int) -> list[int]:
    out = [int(t) for t in prompt]
    with torch.no_grad():
        for _ in range(n):
            ctx = torch.tensor([out[-c.seq_len:]])
            out.append(int(model(ctx)[0, -1].argmax()))
    return out


def check_budget(c: Any) -> None:
    """Refuse sizes that a ``PipelineLMConfig`` ``c`` implies and the driver or a stage cannot hold. The driver: the tokens (see
    :func:`token_memory`) and, for the built-in model, the
    whole model assembled for the final sample, params x 8 bytes (the model and the layer
    states it is loaded from), with params = n_blocks x 12 x d_model^2 + (2 x vocab + seq_len)
    x d_model. A stage: its share of the layers, params / stages x 16 bytes (weights,
    gradients and AdamW's two moments). A factory's model is the user's: not estimated."""
    driver = token_memory(c.data, text_chars=c.text_chars)
    m = c.model
    if m.factory is None:
        vocab = c.data.vocab or (corpus.VOCAB if c.data.path is None else 256)
        params = m.n_blocks * 12 * m.d_model**2 + (2 * vocab + m.seq_len) * m.d_model
        what = f"model.n_blocks ({m.n_blocks}) x 12 x model.d_model ({m.d_model})^2 + (2 x vocab ({vocab}) + model.seq_len ({m.seq_len})) x model.d_model"
        keys = ("model.d_model", "model.n_blocks")
        driver.append(Estimate(f"the assembled model: params ({what}) x 8 bytes", params * 8, keys))
        budget.check("pipeline_lm", [Estimate(f"its layers: params ({what}) / stages ({c.stages}) x 16 bytes", params / c.stages * 16, keys, ("stages",))],
                     where="pipeline stage")
    budget.check("pipeline_lm", driver)
