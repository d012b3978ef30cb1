"""The pipeline's trained state in a checkpoint: one part per stage of the first pipeline
(each stage writes its own layers, :mod:`raylane.checkpoint_parts`; the replicas of a
data-parallel pipeline hold the same values), with which layers each part holds. A
checkpoint of ``P`` stages loads onto any other cut: each stage of the new layout reads
only the parts that hold one of its layers, and keeps its own."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

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
