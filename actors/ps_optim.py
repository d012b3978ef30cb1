"""The update rules a parameter shard applies: SGD, Adagrad and Adam as torch defines them
(eps, bias correction), on float32 numpy arrays, in place, with their state arrays kept
beside the values by the caller. Pure numpy, no Ray.

>>> import numpy as np
>>> value, grad = np.ones(2, np.float32), np.full(2, 0.5, np.float32)
>>> UpdateRule("sgd", 0.1).update(value, grad, {}, 1)
>>> value.tolist()
[0.949999988079071, 0.949999988079071]
"""

from __future__ import annotations

import numpy as np

OPTIMIZERS = ("sgd", "adagrad", "adam")


class UpdateRule:
    """One of :data:`OPTIMIZERS` by name, at learning rate ``lr``, with L2 ``weight_decay``
    added to the gradient as torch's optimizers add it (``grad + weight_decay * value``);
    :meth:`slots` names the state arrays a value needs beside it (zeros to start)."""

    ADAGRAD_EPS, BETAS, ADAM_EPS = 1e-10, (0.9, 0.999), 1e-8

    def __init__(self, name: str, lr: float, weight_decay: float = 0.0):
        self.name, self.lr, self.weight_decay = name, np.float32(lr), np.float32(weight_decay)

    def slots(self) -> tuple[str, ...]:
        return {"sgd": (), "adagrad": ("acc",), "adam": ("m", "v")}[self.name]

    def update(self, value: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: np.ndarray | int) -> None:
        """In place on ``value`` (and ``state``); ``step`` is the update's number (from 1),
        per row for embedding rows."""
        if self.weight_decay:
            grad = grad + self.weight_decay * value
        if self.name == "sgd":
            value -= self.lr * grad
        elif self.name == "adagrad":
            acc = state["acc"]
            acc += grad * grad
            value -= self.lr * grad / (np.sqrt(acc) + np.float32(self.ADAGRAD_EPS))
        else:
            b1, b2 = self.BETAS
            m, v = state["m"], state["v"]
            m *= np.float32(b1)
            m += np.float32(1 - b1) * grad
            v *= np.float32(b2)
            v += np.float32(1 - b2) * grad * grad
            t = np.asarray(step, dtype=np.float64)
            if t.ndim:
                t = t[:, None]
            bc1 = (1 - b1 ** t).astype(np.float32)
            bc2 = np.sqrt(1 - b2 ** t).astype(np.float32)
            value -= (self.lr / bc1) * m / (np.sqrt(v) / bc2 + np.float32(self.ADAM_EPS))
