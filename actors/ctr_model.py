"""ps_ctr's trained model out of the parameter shards, as one torch module, and back.

:func:`export` puts the shards' parts of a checkpoint together: the dense tensors from their
flat ranges, every embedding table whole (``buckets`` rows: those no batch touched at their
initial values, as the shards serve them), and writes ``model.pt`` (a ``state_dict``,
loaded with ``torch.load(weights_only=True)``) with what rebuilds the module (its shape;
for a user's table, the columns, the hashing and the numeric scaling) as JSON.

:class:`CTRModel` is the module: ``forward(ids, numeric)`` gives the logits exactly as the
run's evaluation computed them; ``predict(rows)`` takes a user's rows as they are in the
table (a pyarrow table, a pandas frame, or a dict of columns) and returns click
probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from raylane.actors import ctr
from raylane.actors.ps_layout import init_rows


class CTRModel(torch.nn.Module):
    """ps_ctr's model: an embedding bag per field, the numeric features, an MLP, one logit."""

    def __init__(self, shape: ctr.CTRShape, inputs: dict[str, Any] | None = None):
        """``inputs``: the user's table as the run read it (``categorical``, ``numeric``,
        ``scale``); None for a model trained on generated data (then only :meth:`forward`)."""
        super().__init__()
        self.shape, self.inputs = shape, inputs
        self.dense = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(torch.zeros(s)) for n, s in ctr.dense_shapes(shape).items()})
        self.tables = torch.nn.ParameterDict({ctr.table_name(f): torch.nn.Parameter(torch.zeros(shape.buckets, shape.embedding_dim))
                                              for f in range(shape.fields)})

    def forward(self, ids: np.ndarray | torch.Tensor, numeric: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Logits ``[n]`` of ids ``[n, fields, ids_per_field]`` (hashed buckets) and numeric
        features ``[n, dense_features]`` (scaled as the run read them)."""
        ids = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        uniq, inv = ctr.unique_ids(ids)
        rows = {name: self.tables[name][torch.from_numpy(u)] for name, u in zip(self.tables, uniq)}
        dense = {n: self.dense[n.replace(".", "_")] for n in ctr.dense_shapes(self.shape)}
        return ctr.forward(self.shape, dense, rows, inv, torch.as_tensor(numeric, dtype=torch.float32))

    def predict(self, rows: Any) -> np.ndarray:
        """Click probabilities of ``rows`` (a pyarrow table, a pandas frame, or a dict of
        columns) holding the table's categorical and numeric columns; other columns are ignored."""
        import pyarrow as pa

        from raylane.actors.ctr_files import hash_values

        if self.inputs is None:
            raise ValueError("this model was trained on generated data: call it with (ids, numeric) arrays")
        table = rows if isinstance(rows, pa.Table) else pa.Table.from_pandas(rows) if hasattr(rows, "columns") else pa.table(rows)
        need = [*self.inputs["categorical"], *self.inputs["numeric"]]
        if missing := [c for c in need if c not in table.column_names]:
            raise ValueError(f"rows lack the columns {missing}; the model reads {need}")
        kinds = self.inputs.get("hashed_as") or ["string"] * len(self.inputs["categorical"])
        ids = np.stack([hash_values(_as_trained(table.column(c).combine_chunks(), c, kind), self.shape.buckets)
                        for c, kind in zip(self.inputs["categorical"], kinds)], axis=1)[:, :, None]
        numeric = np.zeros((table.num_rows, len(self.inputs["numeric"])), np.float32)
        for j, c in enumerate(self.inputs["numeric"]):
            values = table.column(c).cast(pa.float64()).to_numpy(zero_copy_only=False).astype(np.float32)
            if self.inputs.get("scale"):
                mean, sd = self.inputs["scale"][j]
                values = (values - np.float32(mean)) / np.float32(sd)
            numeric[:, j] = np.nan_to_num(values, nan=0.0)  # missing: 0 (the mean, when scaled), as the run read it
        with torch.no_grad():
            return torch.sigmoid(self(ids, numeric)).numpy()


def _as_trained(values: Any, name: str, kind: str) -> Any:
    """A categorical column in the type the run hashed it as (``int`` or ``string``): an id
    column that pandas turned into floats (an integer column with missing values) goes back
    to whole numbers; a float that is not whole is refused, naming the column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    if pa.types.is_floating(values.type):
        values = pc.if_else(pc.is_nan(values), pa.scalar(None, values.type), values)  # pandas' missing id
        finite = pc.fill_null(pc.is_finite(values), True)
        whole = pc.fill_null(pc.equal(pc.floor(values), values), True)
        if not pc.all(pc.and_(finite, whole)).as_py():
            raise ValueError(f"column {name!r} holds numbers that are not whole ids; the run hashed it as {kind} ids")
        values = values.cast(pa.int64())
    if kind == "int":
        return values if pa.types.is_integer(values.type) else values.cast(pa.int64())
    return values if pa.types.is_string(values.type) or pa.types.is_large_string(values.type) else values.cast(pa.string())


def export(conf: Any, state: dict, folder: Path) -> dict[str, Any]:
    """``JobSpec.export`` of ps_ctr: ``model.pt`` and the JSON that rebuilds :class:`CTRModel`."""
    about = state.get("model")
    if about is None:  # a checkpoint written before the state described its model: the run's config does
        if conf is None:
            raise ValueError("the checkpoint does not describe its model and the run folder has no config.json; export a newer checkpoint")
        about = {"fields": conf.fields, "ids_per_field": conf.ids_per_field, "dense_features": conf.dense_features, "buckets": conf.buckets,
                 "embedding_dim": conf.embedding_dim, "hidden": conf.hidden, "seed": conf.seed, "init_scale": conf.init_scale, "inputs": None}
    shape = ctr.CTRShape(about["fields"], about["ids_per_field"], about["buckets"], about["dense_features"], about["embedding_dim"], about["hidden"])
    shards = [state["shards"][str(i)] for i in range(len(state["shards"]))]
    tensors = {}
    for name, shp in ctr.dense_shapes(shape).items():
        flat = np.concatenate([np.asarray(s["dense"][name], np.float32).reshape(-1) for s in shards])
        tensors[f"dense.{name.replace('.', '_')}"] = torch.from_numpy(flat.reshape(shp))
    everyone = np.arange(shape.buckets, dtype=np.int64)
    for f in range(shape.fields):
        name = ctr.table_name(f)
        table = init_rows(about["seed"], name, everyone, shape.embedding_dim, about["init_scale"])
        for s in shards:
            held = s["tables"][name]
            table[np.asarray(held["ids"], np.int64)] = np.asarray(held["values"], np.float32).reshape(-1, shape.embedding_dim)
        tensors[f"tables.{name}"] = torch.from_numpy(table)
    torch.save(tensors, folder / "model.pt")
    return {"shape": {k: getattr(shape, k) for k in ("fields", "ids_per_field", "buckets", "dense_features", "embedding_dim", "hidden")},
            "inputs": about["inputs"], "auc": state.get("auc")}


def load(folder: Path, manifest: dict) -> CTRModel:
    """``JobSpec.load_model`` of ps_ctr: :class:`CTRModel` in eval mode."""
    about = manifest["model"]
    model = CTRModel(ctr.CTRShape(**about["shape"]), about["inputs"])
    model.load_state_dict(torch.load(Path(folder) / "model.pt", weights_only=True))
    return model.eval()
