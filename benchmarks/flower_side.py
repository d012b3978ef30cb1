"""Flower's side of ``benchmarks/federated.py``: the same federated problem on Flower's
simulation engine (Ray backend) with Flower's own FedAvg / FedProx strategies.

It runs inside Flower's virtual environment (``flwr[simulation]`` pins its own Ray), never
where raylane is installed, as a subprocess of ``benchmarks/federated.py``::

    .venv-flower/bin/python benchmarks/flower_side.py SPEC_DIR

``SPEC_DIR`` holds ``data.npz`` (rows, client partitions, initial weights ``w_<name>``) and
``config.json`` (algorithm, rounds, clients, budgets, dropouts, ...), both written by
``benchmarks/federated.py``. The local training repeats raylane's client step for step
(the same minibatch order from ``(seed, round, client)``, the same proximal term, the same
step budgets for stragglers); Flower samples the clients of a round itself.

Prints one line to stdout, ``FLOWER_RESULT {json}``: per-round accuracy, loss and wall
seconds (server side, from the start of a round's training to the end of its
aggregation and evaluation), ``wall_s`` (first round's start to the end of the simulation,
Ray's shutdown included), ``startup_s`` (script start to the first round, Ray's start
included), ``rounds_to_target`` and the versions of Flower and Ray. Flower's logs go to stderr.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

STARTED = time.perf_counter()

# Read by flwr and Ray when they are imported: no telemetry or usage reports (the machine
# may have no network, and a report must not hold up the run); and Ray's one-machine mode,
# which makes its node address 127.0.0.1, so every server it starts listens on loopback
# only (Ray turns 127.0.0.1 given to ray.init into the machine's routable address).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import flwr  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg, FedProx  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

CONFIG_KEYS = ("algorithm", "mu", "clients", "clients_per_round", "rounds", "local_epochs", "batch_size", "lr",
               "hidden", "seed", "target_accuracy", "budgets", "dropouts", "actors", "client_cpus")
DATA_KEYS = ("train_x", "train_y", "test_x", "test_y", "part_rows", "part_offsets")

# Error codes of the replies a client sends instead of an update on purpose. Flower's
# strategies only test ``has_error()`` and leave such a reply out of the aggregate; the
# codes (outside Flower's own ErrorCode values) let the server tell them from a crash.
DROPPED_OUT = 1001
PARTIAL_WORK_DROPPED = 1002
EXPECTED_ERRORS = (DROPPED_OUT, PARTIAL_WORK_DROPPED)


@dataclass(frozen=True)
class Spec:
    """The problem as ``benchmarks/federated.py`` wrote it."""

    folder: Path
    config: dict
    data: dict

    def rows(self, client: int) -> np.ndarray:
        offsets = self.data["part_offsets"]
        return self.data["part_rows"][offsets[client] : offsets[client + 1]]

    def initial_state(self) -> dict[str, torch.Tensor]:
        return {k[2:]: torch.from_numpy(v) for k, v in self.data.items() if k.startswith("w_")}


@lru_cache(maxsize=2)
def load_spec(folder: str) -> Spec:
    """Reads a spec folder once per process (Ray's actors keep it across rounds)."""
    path = Path(folder)
    for name in ("data.npz", "config.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"spec folder {path} has no {name} (benchmarks/federated.py writes both)")
    config = json.loads((path / "config.json").read_text())
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{path / 'config.json'} lacks {', '.join(missing)}")
    with np.load(path / "data.npz", allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    missing = [k for k in DATA_KEYS if k not in data] + [k for k in ("w_0.weight", "w_2.weight") if k not in data]
    if missing:
        raise ValueError(f"{path / 'data.npz'} lacks {', '.join(missing)}")
    spec = Spec(path, config, data)
    check_spec(spec)
    return spec


def check_spec(spec: Spec) -> None:
    c, d = spec.config, spec.data
    if c["algorithm"] not in ("fedavg", "fedprox"):
        raise ValueError(f"algorithm must be fedavg or fedprox, got {c['algorithm']!r}")
    if c["algorithm"] == "fedavg" and c["mu"]:
        raise ValueError(f"mu={c['mu']} is FedProx's proximal weight; algorithm fedavg takes none")
    if len(d["part_offsets"]) != c["clients"] + 1:
        raise ValueError(f"part_offsets has {len(d['part_offsets'])} entries for {c['clients']} clients (want clients + 1)")
    if not 1 <= c["clients_per_round"] <= c["clients"]:
        raise ValueError(f"clients_per_round={c['clients_per_round']} must be within 1..clients={c['clients']}")
    if len(c["budgets"]) != c["clients"] or len(c["dropouts"]) < c["rounds"]:
        raise ValueError(f"budgets needs one entry per client ({c['clients']}) and dropouts one list per round ({c['rounds']})")
    if d["w_0.weight"].shape[0] != c["hidden"]:
        raise ValueError(f"w_0.weight has {d['w_0.weight'].shape[0]} rows; config says hidden={c['hidden']}")


def make_model(spec: Spec) -> torch.nn.Module:
    """``Sequential(Linear(in, hidden), ReLU(), Linear(hidden, classes))`` with the spec's initial weights."""
    w0, w2 = spec.data["w_0.weight"], spec.data["w_2.weight"]
    model = torch.nn.Sequential(torch.nn.Linear(w0.shape[1], w0.shape[0]), torch.nn.ReLU(), torch.nn.Linear(w2.shape[1], w2.shape[0]))
    model.load_state_dict(spec.initial_state())
    return model


# --- client side (runs in Flower's Ray actors) -------------------------------------------


def local_train(spec: Spec, client: int, round_: int, state: dict[str, torch.Tensor], mu: float) -> tuple[dict, int, int, int]:
    """Raylane's local step: SGD over the client's rows from the global ``state``, one
    permutation per epoch from ``rng([seed, 19, round, client])``, the proximal term when
    ``mu > 0``, stopping at the client's step budget. Returns (state, rows, steps, planned)."""
    c = spec.config
    torch.set_num_threads(1)
    rows = spec.rows(client)
    x, y = torch.from_numpy(spec.data["train_x"][rows]), torch.from_numpy(spec.data["train_y"][rows])
    model = make_model(spec)
    model.load_state_dict(state)
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=c["lr"])
    batch, epochs, budget = c["batch_size"], c["local_epochs"], c["budgets"][client]
    planned = epochs * math.ceil(len(rows) / batch)
    limit = planned if budget is None else min(planned, budget)
    rng = np.random.default_rng([c["seed"], 19, round_, client])
    steps = 0
    for _ in range(epochs):
        order = rng.permutation(len(rows))
        for start in range(0, len(rows), batch):
            if steps >= limit:
                break
            pick = order[start : start + batch]
            loss = F.cross_entropy(model(x[pick]), y[pick])
            if mu > 0:
                loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
    return model.state_dict(), len(rows), steps, planned


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    spec = load_spec(str(config["spec-dir"]))
    # Flower numbers the simulated nodes' partitions 0..num_supernodes-1: partition k is client k.
    client = int(context.node_config["partition-id"])
    round_ = int(config["server-round"]) - 1  # Flower counts rounds from 1, the spec (and raylane) from 0
    if client in spec.config["dropouts"][round_]:
        # A vanished client: no training, an error reply that the strategy counts as a failure.
        return Message(Error(DROPPED_OUT, f"client {client} dropped out of round {round_}"), reply_to=msg)
    mu = float(config.get("proximal-mu", 0.0))  # FedProx puts its mu in the train config; FedAvg none
    state, rows, steps, planned = local_train(spec, client, round_, msg.content["arrays"].to_torch_state_dict(), mu)
    if spec.config["algorithm"] == "fedavg" and steps < planned:
        # FedAvg drops a straggler's partial work: the client did the work (it costs the
        # round its time) and replies with an error instead of the update, so Flower's
        # FedAvg aggregates the others only (a zero weight would divide by zero when every
        # sampled client is a straggler).
        return Message(Error(PARTIAL_WORK_DROPPED, f"client {client}: {steps} of {planned} steps, dropped under fedavg"), reply_to=msg)
    metrics = MetricRecord({"num-examples": rows, "steps": steps, "planned": planned})
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}), reply_to=msg)


# --- server side (runs in this process) --------------------------------------------------


class TargetReached(Exception):
    """Raised from the evaluation hook to end ``Strategy.start`` before its last round."""


class Rounds:
    """The centralized evaluation hook, which also clocks the rounds and stops at the target.

    ``Strategy.start`` calls the hook with round 0 just before round 1's first message and
    with round r as the last thing in round r, so the moments it returns split the rounds."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.model = make_model(spec)
        self.test_x = torch.from_numpy(spec.data["test_x"])
        self.test_y = torch.from_numpy(spec.data["test_y"])
        self.accuracy: list[float] = []
        self.loss: list[float] = []
        self.round_s: list[float] = []
        self.first_start: float | None = None
        self._mark = 0.0

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # the initial model: not reported, only the start of round 1
            self.first_start = self._mark = time.perf_counter()
            return None
        self.model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            logits = self.model(self.test_x)
        accuracy, loss = float((logits.argmax(1) == self.test_y).float().mean()), float(F.cross_entropy(logits, self.test_y))
        now = time.perf_counter()
        self.accuracy.append(accuracy)
        self.loss.append(loss)
        self.round_s.append(now - self._mark)
        self._mark = now
        target = self.spec.config["target_accuracy"]
        if target and target > 0 and accuracy >= target:
            raise TargetReached  # Flower's strategies have no early stop of their own
        return MetricRecord({"accuracy": accuracy, "loss": loss})


def make_strategy(spec: Spec) -> FedAvg:
    """Flower's FedAvg or FedProx, sampling exactly ``clients_per_round`` nodes a round,
    with no client-side evaluation (the server evaluates), and failing loudly on a reply
    that is an error other than a planned dropout or dropped partial work."""
    c = spec.config
    base = FedProx if c["algorithm"] == "fedprox" else FedAvg
    extra = {"proximal_mu": float(c["mu"])} if base is FedProx else {}

    class Checked(base):  # type: ignore[valid-type, misc]
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            crashed = [m.error.reason for m in replies if m.has_error() and m.error.code not in EXPECTED_ERRORS]
            if crashed:
                raise RuntimeError(f"a client failed in round {server_round}: {crashed[0]}")
            return super().aggregate_train(server_round, replies)

    # The strategy samples max(int(nodes * fraction_train), min_train_nodes) nodes: the
    # minimum makes it exactly clients_per_round whatever the float rounding.
    return Checked(fraction_train=c["clients_per_round"] / c["clients"], min_train_nodes=c["clients_per_round"],
                   fraction_evaluate=0.0, min_evaluate_nodes=0, min_available_nodes=c["clients"], **extra)


def make_server_app(spec: Spec, rounds: Rounds) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        initial = ArrayRecord({k: v.clone() for k, v in spec.initial_state().items()})
        train_config = ConfigRecord({"spec-dir": str(spec.folder)})
        try:
            make_strategy(spec).start(grid=grid, initial_arrays=initial, num_rounds=spec.config["rounds"],
                                      train_config=train_config, evaluate_fn=rounds)
        except TargetReached:
            pass

    return app


def start_ray(spec: Spec) -> None:
    """A Ray of ``actors x client_cpus`` CPUs started here (never an existing cluster), on
    loopback, without a dashboard; Flower's backend then fits ``actors`` clients in it.

    Started before ``run_simulation`` (whose Ray backend takes a running Ray as it finds it)
    because Flower's ServerApp thread opens round 1 while the backend is still starting Ray:
    this way Ray's start-up counts as start-up, not as part of the first round."""
    c = spec.config
    here = str(Path(__file__).resolve().parent)
    # Flower's own start of Ray passes the driver's sys.path to the workers the same way;
    # they need this folder to import this file by name (see the end of the file).
    pythonpath = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=max(1, round(c["actors"] * c["client_cpus"])), include_dashboard=False,
             log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})


def backend_config(spec: Spec) -> dict:
    return {"client_resources": {"num_cpus": float(spec.config["client_cpus"]), "num_gpus": 0.0}}


def first_at(accuracy: list[float], target: float) -> int | None:
    if not target or target <= 0:
        return None
    return next((i + 1 for i, a in enumerate(accuracy) if a >= target), None)


def main(argv: list[str], started: float = STARTED) -> int:
    if len(argv) != 1:
        print(f"usage: {Path(sys.argv[0]).name} SPEC_DIR", file=sys.stderr)
        return 2
    try:
        spec = load_spec(str(Path(argv[0]).resolve()))
    except (OSError, ValueError) as e:
        print(f"flower_side: {e}", file=sys.stderr)
        return 2
    logging.getLogger("flwr").setLevel(logging.WARNING)
    rounds = Rounds(spec)
    start_ray(spec)
    try:
        run_simulation(server_app=make_server_app(spec, rounds), client_app=client_app,
                       num_supernodes=spec.config["clients"], backend_config=backend_config(spec))
    finally:
        ray.shutdown()
    end = time.perf_counter()
    first = rounds.first_start if rounds.first_start is not None else end
    result = {
        "rounds": len(rounds.accuracy), "accuracy": rounds.accuracy, "loss": rounds.loss, "round_s": rounds.round_s,
        "wall_s": end - first, "startup_s": first - started,
        "rounds_to_target": first_at(rounds.accuracy, spec.config["target_accuracy"]),
        "flwr": flwr.__version__, "ray": ray.__version__,
    }
    print("FLOWER_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    # Run the module imported by name, not as __main__: Ray then pickles the ClientApp's
    # functions by reference and each actor imports this file once (start_ray puts its
    # folder on the workers' PYTHONPATH), so the spec read by load_spec stays cached in the
    # actor across rounds instead of being re-read on every call.
    import flower_side

    sys.exit(flower_side.main(sys.argv[1:], started=STARTED))
