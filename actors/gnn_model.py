"""graphsage's trained GNN out of a checkpoint, as one torch module, and back.

:func:`describe` is what the workload's state says about its model (layer type and
widths: what rebuilds :class:`raylane.actors.sage.GNN`). :func:`export` writes the
trainer's weights as ``model.pt`` (a ``state_dict``, loaded with
``torch.load(weights_only=True)``) and returns that description as JSON; :func:`load`
rebuilds the module from it, in eval mode, in a process where Ray need not run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raylane.actors.sage import GNN, MODELS, GNNTrainerConfig

MODEL_FILE = "model.pt"


def describe(tc: GNNTrainerConfig) -> dict[str, Any]:
    """What rebuilds the trainer's GNN (JSON): the layer type and the widths."""
    return {"kind": tc.model, "in_dim": tc.in_dim, "hidden": tc.hidden, "classes": tc.num_classes,
            "layers": tc.layers, "heads": tc.heads, "dropout": tc.dropout}


def _tensors(weights: dict) -> dict[str, torch.Tensor]:
    """The trainer's saved ``state_dict`` (tensors or numpy arrays, as the checkpoint read
    them) as CPU tensors of their own."""
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)) for k, v in weights.items()}


def _from_config(conf: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """:func:`describe` of a checkpoint written before the state described its model: layer
    type and widths from the run's config; feature width and classes (which the config does
    not hold for a user's graph) from the first and last layer's weight matrices."""
    layers = sorted({int(m.group(1)) for k in tensors if (m := re.match(r"convs\.(\d+)\.", k))})
    if not layers or layers != list(range(len(conf.fanouts))):
        raise ValueError(f"the checkpoint's weights have layers {layers}, the run's config {len(conf.fanouts)} (fanouts={list(conf.fanouts)}); "
                         "export a checkpoint written by this version of graphsage")
    first = [v for k, v in tensors.items() if k.startswith("convs.0.") and v.dim() == 2]
    last = [v for k, v in tensors.items() if k.startswith(f"convs.{layers[-1]}.") and v.dim() == 2]
    return {"kind": conf.model, "in_dim": int(first[0].shape[1]), "hidden": conf.hidden, "classes": int(last[-1].shape[0]),
            "layers": len(layers), "heads": conf.heads, "dropout": conf.dropout}


def export(conf: Any, state: dict, folder: Path) -> dict[str, Any]:
    """``JobSpec.export`` of graphsage: ``model.pt`` (the trainer's ``state_dict``) and the JSON
    that rebuilds the GNN (``gnn``), with the held-out accuracies of the last evaluation
    (``eval``: ``val_acc``, ``test_acc``; empty before the first epoch ended)."""
    tensors = _tensors(state["trainer"]["model"])
    about = state.get("model")
    if about is None:  # a checkpoint written before the state described its model: the run's config does
        if conf is None:
            raise ValueError("the checkpoint does not describe its model (it predates graphsage's export) and the run folder has "
                             "no config.json to say which; export a checkpoint written by this version, or a run started with `raylane run`")
        about = _from_config(conf, tensors)
    torch.save(tensors, Path(folder) / MODEL_FILE)
    last = state.get("last_eval") or {}
    return {"gnn": dict(about), "eval": {k: float(last[k]) for k in ("val_acc", "test_acc") if k in last},
            "batches": int(state["trainer"].get("batches", 0))}


def build(about: dict[str, Any]) -> GNN:
    """An untrained :class:`GNN` of the shape ``about`` (:func:`describe`) gives; the caller's
    random state is left as it was."""
    if about.get("kind") not in MODELS:
        raise ValueError(f"the export's layer type {about.get('kind')!r} is not one of {', '.join(MODELS)}; export the run again")
    with torch.random.fork_rng(devices=[]):
        return GNN(int(about["in_dim"]), int(about["hidden"]), int(about["classes"]), int(about["layers"]),
                   float(about.get("dropout", 0.0)), about["kind"], int(about.get("heads", 4)))


def load(folder: Path, manifest: dict) -> GNN:
    """``JobSpec.load_model`` of graphsage; call it as ``raylane.api.load_model("runs/NAME")``
    (or the export folder). Returns the trained :class:`raylane.actors.sage.GNN` in eval mode,
    on the CPU. ``model(x, edge_index)`` gives the logits ``[N, classes]`` of every node:
    ``x`` the float32 features ``[N, in_dim]`` (float32 whatever ``feature_dtype`` the run
    stored them in), ``edge_index`` either a long tensor ``[2, E]`` (row 0 the source, row 1
    the target of each edge; give both directions of an undirected edge, as the run used
    them) or the in-neighbour sparse adjacency of :func:`raylane.actors.sage.adjacency`, with
    which it computes what the run's evaluation computed (full neighbourhoods).
    ``manifest["model"]["gnn"]`` holds the layer type and widths, ``["eval"]`` the run's
    accuracies at the exported step."""
    model = build(manifest["model"]["gnn"])
    model.load_state_dict(torch.load(Path(folder) / MODEL_FILE, weights_only=True, map_location="cpu"))
    return model.eval()
