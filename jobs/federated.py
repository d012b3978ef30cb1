"""``raylane run federated``: FedAvg and FedProx over clients with their own data, on (spot) client actors.

Each round (one driver step) the server samples ``clients_per_round`` of the logical
clients, puts the global weights in the object store once, and hands the clients to the
client actors' task pool (an actor serves any number of logical clients in turn). Every
client trains locally until its epochs are done or the round's deadline comes; the server
gathers what came back by the deadline and averages the models weighted by the clients'
rows. FedProx keeps the partial work of clients that ran out of time (its proximal term
keeps those updates near the global model); FedAvg, as usually run, drops them.

Faults cost one round's update of the clients they hit: a client actor lost mid-round is
dropped from that round (the pool starts a replacement; its logical clients are served
by whichever actor is free next round), and the server never waits past the deadline.
The server's state is the global model: rounds pick their clients from ``(seed, round)``,
so a resumed run goes on exactly as an uninterrupted one.

The rows are scikit-learn's digits split over ``clients`` (IID or Dirichlet label skew),
or the user's own table whose client-id column says whose each row is (``data.path``).

    raylane run federated
    raylane run federated --set alpha=0.1 --set stragglers=0.5 --set algorithm=fedavg
    raylane run federated --set data.path=visits/ --set data.client_column=hospital --set data.label=diagnosis
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import ray
import torch
import torch.nn.functional as F

from raylane import config as cfg
from raylane.actors.fed_client import ClientConfig, FedClient, make_model
from raylane.actors.fed_data import DIGITS_CLIENTS, FedDataConfig, FedSource, describe_table, load, load_digits_split
from raylane.actors.fed_math import aggregate, drops_out, is_straggler, partition, sample_clients
from raylane.api import BaseWorkload, Context, DriverConfig, JobSpec, RoleSpec, TaskPool
from raylane.launch import job_main
from raylane.runlog import say

ROLE = "fed_client"
FEDPROX_MU = 0.01


@dataclass
class FederatedConfig:
    """Federated training of a classifier on clients' own rows: your table with a client-id
    column, or scikit-learn's digits split over clients."""

    data: FedDataConfig = field(default_factory=FedDataConfig)
    """Your table (data.path) with a client-id column; scikit-learn's digits without one."""
    clients: int | None = cfg.field(None, ge=1)
    """Logical clients the digits are split over (null: 20). With data.path the table's
    client ids decide; a number given must match theirs."""
    clients_per_round: int = cfg.field(5, ge=1)
    """Clients sampled each round."""
    actors: int = cfg.field(2, ge=1)
    """Client actors to start (each serves several logical clients in turn)."""
    max_actors: int = cfg.field(16, ge=1)
    """Most client actors the pool may grow to."""
    algorithm: Literal["fedavg", "fedprox"] = "fedprox"
    """fedprox: clients add mu/2 ||w - w_global||^2 to their loss, and the partial work of
    clients that ran out of time counts; fedavg: no proximal term, and clients that did not
    finish their epochs by the deadline are dropped from the round."""
    mu: float | None = cfg.field(None, ge=0)
    """FedProx's proximal weight (null: 0.01); fedavg takes none."""
    local_epochs: int = cfg.field(2, ge=1)
    """Passes over its rows a client makes per round (fewer if the deadline comes first)."""
    batch_size: int = cfg.field(16, ge=1)
    """Rows per local step."""
    lr: float = cfg.field(0.05, gt=0)
    """Local SGD step size."""
    hidden: int = cfg.field(64, ge=1)
    """Hidden units of the MLP."""
    alpha: float | None = cfg.field(None, gt=0)
    """Label skew of the digits split: each class split over the clients by Dirichlet(alpha)
    (0.1: most of a client's rows are of one or two classes); null: IID. Not with data.path."""
    stragglers: float = cfg.field(0.0, ge=0, le=1)
    """Share of clients emulated as slow (fixed per client): they get through 1/slowdown of
    their planned steps in a round, so their work is partial. The effect is the same on any
    machine (no timing); real slowness meets the deadline instead."""
    slowdown: float = cfg.field(4.0, ge=1)
    """How much slower an emulated straggler is."""
    dropout: float = cfg.field(0.0, ge=0, lt=1)
    """Chance that a sampled client vanishes for the round (emulated; drawn per round and client)."""
    round_deadline_s: float = cfg.field(30.0, gt=0)
    """Longest a round's local training may run; the server never waits longer (plus a short grace)."""
    test_fraction: float = cfg.field(0.2, gt=0, lt=1)
    """Share of the rows held out for the server's evaluation (of each client's rows with
    data.path, each keeping at least one)."""
    target_accuracy: float = cfg.field(0.0, ge=0, le=1)
    """Stop once the held-out accuracy reaches this (0: run all rounds)."""
    client_cpus: float = cfg.field(0.5, gt=0)
    """CPUs each client actor reserves."""
    seed: int = 0
    """Seed of the split, the model, the sampling, the stragglers and the dropouts."""
    driver: DriverConfig = field(default_factory=lambda: DriverConfig(max_steps=30, checkpoint_every_steps=5))
    """Run name, stop rules (a step is a round), checkpoints."""

    def validate(self) -> None:
        if self.actors > self.max_actors:
            raise ValueError(f"actors ({self.actors}) must not exceed max_actors ({self.max_actors})")
        if self.algorithm == "fedavg" and self.mu:
            raise ValueError(f"mu={self.mu} is FedProx's proximal weight; algorithm=fedavg has none: set algorithm=fedprox or drop mu")
        if self.data.path is not None and self.alpha is not None:
            raise ValueError(f"alpha={self.alpha} skews the digits split; with data.path the column "
                             f"{self.data.client_column!r} says whose each row is: drop alpha")
        if self.data.path is None and self.clients_per_round > (self.clients or DIGITS_CLIENTS):
            raise ValueError(f"clients_per_round ({self.clients_per_round}) cannot exceed clients ({self.clients or DIGITS_CLIENTS})")

    def source(self) -> FedSource:
        """Where the rows come from; a table is checked here (columns, labels, client ids)."""
        if self.data.path is None:
            return FedSource(self.seed, self.test_fraction, self.clients or DIGITS_CLIENTS, self.alpha)
        table = describe_table(self.data)
        if self.clients is not None and self.clients != len(table.client_ids):
            raise ValueError(f"clients={self.clients}, but column {table.client_column!r} of {table.path!r} names "
                             f"{len(table.client_ids)} clients: drop clients (the table decides) or fix the column")
        table.held_out(self.test_fraction)
        return FedSource(self.seed, self.test_fraction, len(table.client_ids), table=table)

    @property
    def proximal(self) -> float:
        return 0.0 if self.algorithm == "fedavg" else (FEDPROX_MU if self.mu is None else self.mu)


def prepare(c: FederatedConfig) -> FedSource:
    """The job's prepare: where the rows come from, read and checked once (a table's columns,
    labels and client ids; every client of the digits split gets rows), before Ray starts."""
    source = c.source()
    if c.clients_per_round > source.clients:
        raise ValueError(f"clients_per_round ({c.clients_per_round}) cannot exceed clients ({source.clients})")
    if source.table is None:
        _, y, _, _ = load_digits_split(c.seed, c.test_fraction)
        partition(y, source.clients, c.alpha, c.seed)  # every client gets rows, or a clear error now
    return source


class FederatedWorkload(BaseWorkload):
    name = "federated"
    main_metric = "accuracy"
    guarded_metrics = ("loss",)
    metrics = ("accuracy", "loss", "participants", "partial", "dropped", "lost", "late", "round_s", "actors")
    progress_metrics = ("accuracy", "participants")

    def __init__(self, config: FederatedConfig, source: FedSource | None = None):
        """``source``: where the rows come from, as :func:`prepare` checked it; read here when None."""
        self.config = config
        c = config
        self.source = source if source is not None else prepare(config)
        # Budget, before the rows are read: here and again in every client actor (each reads
        # them all), rows x (features x 12 bytes: the columns read, their float32 matrix and the
        # training copy; + 100 a row for label, owner, indices and the client id as read).
        from raylane import budget
        t = self.source.table
        rows, feats = (1797, 64) if t is None else (sum(t.client_rows), len(t.features))  # the digits: 1797 images of 8 x 8
        need = [budget.Estimate(f"rows: {rows:,} rows x ({feats} features x 12 + 100) bytes", rows * (feats * 12 + 100), "data.path's size")]
        budget.check(self.name, need)
        budget.check(self.name, need, where="client actor")
        data = load(self.source)
        self.test_x, self.test_y = torch.from_numpy(data.test_x), torch.from_numpy(data.test_y)
        self.rows = [len(p) for p in data.parts]
        self.model = make_model(data.x.shape[1], c.hidden, data.classes, c.seed)
        self.weights = {k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()}
        self.pool: TaskPool | None = None

    def roles(self) -> list[RoleSpec]:
        c = self.config
        return [RoleSpec(ROLE, {"CPU": c.client_cpus}, min_count=1, max_count=c.max_actors, want=c.actors)]

    def setup(self, ctx: Context) -> None:
        c = self.config
        if (t := self.source.table) is not None:
            shown = ", ".join(map(repr, t.client_ids[:5])) + (", ..." if len(t.client_ids) > 5 else "")
            missing = "; missing cells read as 0: " + ", ".join(f"{c} ({n})" for c, n in t.missing) if t.missing else ""
            say(f"federated: {len(t.client_ids)} clients ({t.client_column}: {shown}), {t.classes} classes, "
                f"{len(t.features)} features; {len(self.test_y)} rows held out for the server{missing}")
            ctx.log.event("federated_data", path=t.path, clients=len(t.client_ids), classes=t.classes,
                          features=list(t.features), held_out=len(self.test_y), train_rows=sum(self.rows), missing_as_0=dict(t.missing))
        client = ClientConfig(self.source, c.hidden, c.lr, c.batch_size)
        # A call never outlives its round by much (clients stop at the deadline), so the
        # pool's own timeout only catches an actor that hangs.
        self.pool = ctx.task_pool(ROLE, FedClient, actor_args=lambda key: ((client,), {}), call_timeout_s=c.round_deadline_s + self.grace_s + 60.0)
        self.pool.wait_ready(timeout_s=180)

    @property
    def grace_s(self) -> float:
        """How long after the deadline the server waits for the replies of clients that stopped at it."""
        return min(5.0, 0.5 * self.config.round_deadline_s)

    def step(self, step: int) -> dict[str, Any]:
        assert self.pool is not None
        c = self.config
        t0 = time.monotonic()
        sampled = sample_clients(c.seed, step, self.source.clients, c.clients_per_round)
        dropped = [k for k in sampled if drops_out(c.seed, step, k, c.dropout)]
        weights = ray.put(self.weights)
        deadline = time.time() + c.round_deadline_s
        tickets = {}
        for k in sampled:
            if k in dropped:
                continue
            steps = _planned(self.rows[k], c.batch_size, c.local_epochs)
            budget = max(1, int(steps / c.slowdown)) if is_straggler(c.seed, k, c.stragglers) else None
            tickets[self.pool.submit("train", k, weights, step, c.local_epochs, c.proximal, deadline, budget, retry=False)] = k
        done = self.pool.gather(tickets, timeout_s=c.round_deadline_s + self.grace_s, partial=True)
        lost = sorted(tickets[t] for t in self.pool.lost())
        late = sorted(k for t, k in tickets.items() if t not in done and k not in lost)
        results = sorted(done.values(), key=lambda r: r["client"])  # client order: the same sum on a rerun
        partial = [r["client"] for r in results if 0 < r["steps"] < r["planned"]]
        used = [r for r in results if r["steps"] > 0 and (c.algorithm == "fedprox" or r["steps"] == r["planned"])]
        if used:
            self.weights = aggregate([(r["weights"], float(r["rows"])) for r in used])
        accuracy, loss = self._evaluate()
        return {
            "accuracy": accuracy, "loss": loss, "participants": len(used), "partial": len(partial),
            "dropped": len(dropped) + len(lost) + len(late) + (len(partial) if c.algorithm == "fedavg" else 0),
            "lost": len(lost), "late": len(late), "round_s": time.monotonic() - t0, "actors": len(self.pool.actors()),
            "clients": [r["client"] for r in used],
        }

    def _evaluate(self) -> tuple[float, float]:
        self.model.load_state_dict({k: torch.as_tensor(v) for k, v in self.weights.items()})
        with torch.no_grad():
            logits = self.model(self.test_x)
        return float((logits.argmax(1) == self.test_y).float().mean()), float(F.cross_entropy(logits, self.test_y))

    def done(self, step: int, metrics: dict[str, Any]) -> bool:
        return self.config.target_accuracy > 0 and metrics["accuracy"] >= self.config.target_accuracy

    def state_dict(self) -> dict:
        return {"weights": {k: v.copy() for k, v in self.weights.items()}, "model": self.about()}

    def about(self) -> dict[str, Any]:
        """What rebuilds the global model outside raylane (:func:`export`): its widths and
        what its inputs are (the table's feature columns in order, or the digits' pixels)."""
        t = self.source.table
        return {"in_dim": self.model[0].in_features, "hidden": self.model[0].out_features, "classes": self.model[2].out_features,
                "inputs": _inputs(t.features if t is not None else None, None if t is None else t.label)}

    def load_state_dict(self, state: dict) -> None:
        self.weights = {k: np.asarray(v).copy() for k, v in state["weights"].items()}


def _planned(rows: int, batch_size: int, epochs: int) -> int:
    return epochs * -(-rows // batch_size)


MODEL_FILE = "model.pt"


def _inputs(features: Any, label: str | None) -> dict[str, Any]:
    """What the model's input columns are: a table's features in order (None: every numeric
    column but the client id and the label, in the table's order), or the digits' pixels."""
    if label is None:
        return {"digits": "scikit-learn's load_digits: the 64 pixels of an 8x8 image (0..16) divided by 16, row by row"}
    return {"features": None if features is None else list(features), "label": label, "missing": 0.0}


def export(conf: FederatedConfig | None, state: dict, folder: Path) -> dict[str, Any]:
    """``JobSpec.export`` of federated: the global model's ``state_dict`` as ``model.pt`` and
    the JSON that rebuilds it (``in_dim``, ``hidden``, ``classes``; ``inputs``: the features
    it reads, in order)."""
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state["weights"].items()}
    about = state.get("model")
    if about is None:  # a checkpoint written before the state described its model: the run's config does
        if conf is None:
            raise ValueError("the checkpoint does not describe its model (it predates federated's export) and the run folder has "
                             "no config.json to say what it reads; export a checkpoint written by this version, or a run started with `raylane run`")
        d = conf.data
        w1, w2 = tensors["0.weight"], tensors["2.weight"]  # Linear(in_dim, hidden), ReLU, Linear(hidden, classes)
        about = {"in_dim": int(w1.shape[1]), "hidden": int(w1.shape[0]), "classes": int(w2.shape[0]),
                 "inputs": _inputs(d.features or None, None if d.path is None else d.label)}
    torch.save(tensors, Path(folder) / MODEL_FILE)
    return dict(about)


def load_model(folder: Path, manifest: dict) -> torch.nn.Module:
    """``JobSpec.load_model`` of federated; call it as ``raylane.api.load_model("runs/NAME")``
    (or the export folder). Returns the global model in eval mode, on the CPU: a
    ``torch.nn.Sequential`` (Linear, ReLU, Linear) whose ``model(x)`` maps float32 rows
    ``[n, in_dim]`` to class logits ``[n, classes]`` (``argmax(1)``: the predicted class).
    ``model.inputs`` (also ``manifest["model"]["inputs"]``) says what the columns of ``x``
    are: a table's feature columns in order, a missing cell as 0, or the digits' pixels / 16."""
    about = manifest["model"]
    model = make_model(int(about["in_dim"]), int(about["hidden"]), int(about["classes"]), seed=0)  # every weight is then loaded
    model.load_state_dict(torch.load(Path(folder) / MODEL_FILE, weights_only=True, map_location="cpu"))
    model.inputs = about.get("inputs")
    return model.eval()


JOB = JobSpec("federated", "FedAvg / FedProx over logical clients with their own (non-IID) data, digits or your table, on spot client actors; partial work of stragglers counts.",
              FederatedConfig, FederatedWorkload, prepare=prepare, export=export, load_model=load_model)

if __name__ == "__main__":
    job_main(JOB)
