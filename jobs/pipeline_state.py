"""The pipeline's trained state in a checkpoint: one part per stage of the first pipeline
(each stage writes its own layers, :mod:`raylane.checkpoint_parts`; the replicas of a
data-parallel pipeline hold the same values), with which layers each part holds. A
checkpoint of ``P`` stages loads onto any other cut: each stage of the new layout reads
only the parts that hold one of its layers, and keeps its own.

:func:`export` puts the layers back in one ``torch.nn.Sequential`` (``raylane export``),
:func:`load` rebuilds it without Ray (``raylane.api.load_model``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from raylane.actors import gpt
from raylane.actors.lm_factory import LayerFactory
from raylane.checkpoint_parts import Part, snapshot


def snapshot_stages(stages: Sequence[Any], pieces: Sequence[Mapping[int, Sequence[int]]], timeout_s: float) -> dict[str, Any]:
    """``{"stages": {index: Part}, "held": {index: [layer ids]}}`` for the stages of one
    pipeline, ``pieces[s]`` being stage ``s``'s layers by virtual stage."""
    parts: dict[str, Part] = snapshot({str(s): h for s, h in enumerate(stages)}, timeout_s)
    held = {str(s): sorted(i for ids in pieces[s].values() for i in ids) for s in range(len(stages))}
    return {"stages": parts, "held": held}


def held_layers(state: Mapping[str, Any], n_layers: int) -> dict[str, list[int]]:
    """The layers each part holds, checked to cover the model's ``n_layers`` layers."""
    held = {str(k): [int(i) for i in v] for k, v in state["held"].items()}
    if set(held) != set(map(str, state["stages"])):
        raise ValueError(f"the checkpoint's pipeline parts {sorted(state['stages'])} and their layer lists {sorted(held)} differ")
    covered = {i for ids in held.values() for i in ids}
    if missing := [i for i in range(n_layers) if i not in covered]:
        raise ValueError(f"the checkpoint has no state for layers {missing}: it is not of this model ({n_layers} layers)")
    return held


def parts_for(state: Mapping[str, Any], held: Mapping[str, Sequence[int]], layer_ids: Sequence[int]) -> list[Any]:
    """The parts of ``state["stages"]`` a stage holding ``layer_ids`` reads."""
    want = set(layer_ids)
    return [state["stages"][k] for k, ids in sorted(held.items(), key=lambda kv: int(kv[0])) if want & set(ids)]


def layers_of(workload_state: Mapping[str, Any]) -> dict[str, Any]:
    """Layer index (as text) -> layer state, from the job's state with its parts read
    (:meth:`~raylane.checkpoint.CheckpointStore.load_whole`), of either form: parts per
    stage, or the whole layers (a checkpoint written through the driver)."""
    if "layers" in workload_state:
        return dict(workload_state["layers"])
    out: dict[str, Any] = {}
    for part in workload_state["stages"].values():
        if not isinstance(part, Mapping):
            raise TypeError(f"a pipeline part is {type(part).__name__}, not read: load the checkpoint with load_whole()")
        out.update(part)
    return out


def describe(model: gpt.GPTConfig, factory: LayerFactory | None) -> dict[str, Any]:
    """What rebuilds the model outside raylane, kept in every checkpoint: the built-in GPT's
    shape, or the user's factory by import path with what it is called with."""
    if factory is None:
        return {"kind": "gpt", "gpt": asdict(model)}
    from raylane.registry import portable_target  # a factory file's path made absolute: found from any folder

    return {"kind": "factory", "factory": portable_target(factory.name), "vocab": factory.spec.vocab, "seq_len": factory.spec.seq_len, "seed": factory.seed}


def _modules(about: Mapping[str, Any]) -> list[torch.nn.Module]:
    if about["kind"] == "gpt":
        return gpt.build_layers(gpt.GPTConfig(**about["gpt"]))
    from raylane.jobs.pipeline_inputs import load_factory

    factory, _ = load_factory(about["factory"], vocab=about["vocab"], seq_len=about["seq_len"], seed=about["seed"])
    return factory.build()[0]


def export(conf: Any, state: dict, folder: Path) -> dict[str, Any]:
    """``JobSpec.export``: ``model.pt``, the ``state_dict`` of every layer put back in one
    ``torch.nn.Sequential`` (layer ``i`` is its module ``i``), and what rebuilds it."""
    about = state.get("model")
    if about is None:  # a checkpoint written before the state described its model: the run's config does
        if conf is None:
            raise ValueError("the checkpoint does not describe its model and the run folder has no config.json; export a newer checkpoint")
        _, model, factory, _ = conf.inputs()  # the tokens read again, for the vocabulary
        about = describe(model, factory)
    layers = layers_of(state)
    mods = _modules(about)
    for i, m in enumerate(mods):
        gpt.load_layer_state(m, None, layers[str(i)])
    torch.save(torch.nn.Sequential(*mods).state_dict(), folder / "model.pt")
    return {**about, "layers": len(mods), "last_loss": state.get("last_loss"), "imports": [about["factory"]] if about["kind"] == "factory" else []}


def load(folder: Path, manifest: dict) -> torch.nn.Sequential:
    """``JobSpec.load_model``: the whole model in eval mode; ``model(tokens [B, T] int64)``
    gives the next-token logits ``[B, T, vocab]`` (the built-in GPT), or what the factory's
    last layer gives. A factory's model is built by importing the factory named in the
    export (the user's own code), then loaded with the exported weights."""
    model = torch.nn.Sequential(*_modules(manifest["model"]))
    model.load_state_dict(torch.load(Path(folder) / "model.pt", weights_only=True))
    return model.eval()
