"""A click log shaped like a real one, with a known signal: string user, ad and site ids
(few common, most rare), the hour, a price, and a 0/1 ``clicked`` label drawn from a logit
that is known row by row, so the best AUC any model can reach on it (the Bayes AUC) can be
printed beside what a model reached.

The logit is a bias, an effect per user, per ad and per site (normal, each id its own), a
daily cycle in the hour, a falling effect of the log price, a user x ad affinity (the dot
product of hidden tastes, as in the logs recommenders learn from) and a small ad x site
interaction (ads and sites fall in four kinds; a matching kind adds to the logit). The
interactions are what a model with crossed features (embeddings) can learn and a linear
one cannot; ``affinity=0, match=0`` gives a log a linear model fits as well as any.

For ``ps_ctr``'s quality benchmark and tests, and for a user who wants to try the job on a
table like their own: ``python -m raylane.actors.click_log clicks 120000`` writes one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ClickLogShape:
    """How many ids of each kind, and how strong each effect is."""

    users: int = 20_000
    ads: int = 2_000
    sites: int = 300
    user_sd: float = 0.6
    ad_sd: float = 0.8
    site_sd: float = 0.5
    hour_amp: float = 0.3
    price_slope: float = -0.4
    match: float = 0.5
    """Added to the logit when the ad's kind matches the site's."""
    affinity: float = 1.0
    """Scale of the user x ad affinity: the dot product of a user's and an ad's hidden tastes."""
    tastes: int = 4
    """Dimensions of those tastes."""
    bias: float = -1.6


def _popular(rng: np.random.Generator, n: int, count: int) -> np.ndarray:
    """``n`` draws from ``count`` ids where a few are common and most are rare (power law)."""
    return np.minimum((count * rng.random(n) ** 3).astype(np.int64), count - 1)


def click_log(rows: int, seed: int = 0, shape: ClickLogShape = ClickLogShape()):
    """``(table, logit)``: a pyarrow table of ``rows`` clicks (columns user_id, ad_id, site_id,
    hour, price, clicked) and the true logit of each row. The ids' effects come from ``seed``
    alone, so two logs of one seed share them (a held-out log scores against the same truth)."""
    import pyarrow as pa

    if rows < 1:
        raise ValueError(f"rows={rows!r}: a click log needs at least 1 row")
    effects = np.random.default_rng([seed, 1])
    user_fx, ad_fx, site_fx = (effects.normal(0.0, sd, n) for n, sd in ((shape.users, shape.user_sd), (shape.ads, shape.ad_sd), (shape.sites, shape.site_sd)))
    user_taste, ad_taste = (effects.normal(0.0, shape.tastes ** -0.5, (n, shape.tastes)) for n in (shape.users, shape.ads))
    rng = np.random.default_rng([seed, 2])
    user, ad, site = _popular(rng, rows, shape.users), _popular(rng, rows, shape.ads), _popular(rng, rows, shape.sites)
    hour = rng.integers(0, 24, rows)
    price = np.round(rng.lognormal(1.0, 0.8, rows), 2)
    logit = (shape.bias + user_fx[user] + ad_fx[ad] + site_fx[site] + shape.hour_amp * np.sin(2 * np.pi * hour / 24)
             + shape.price_slope * (np.log(price + 0.01) - 1.0) + shape.match * ((ad % 4) == (site % 4))
             + shape.affinity * np.einsum("ij,ij->i", user_taste[user], ad_taste[ad]))
    clicked = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    table = pa.table({"user_id": pa.array([f"u{i}" for i in user]), "ad_id": pa.array([f"ad{i}" for i in ad]),
                      "site_id": pa.array([f"site{i}" for i in site]), "hour": pa.array(hour, pa.int64()),
                      "price": pa.array(price), "clicked": pa.array(clicked)})
    return table, logit


def write_click_log(folder: str | Path, rows: int, *, files: int = 4, seed: int = 0, shape: ClickLogShape = ClickLogShape()) -> np.ndarray:
    """Write ``rows`` clicks as ``files`` Parquet files in ``folder`` (in row order); returns the true logits."""
    import pyarrow.parquet as pq

    if files < 1 or files > rows:
        raise ValueError(f"files={files!r}: give 1 to rows ({rows}) files")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    table, logit = click_log(rows, seed, shape)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(table.slice(int(a), int(b - a)), folder / f"part-{i:04d}.parquet")
    return logit


def bayes_auc(logit: np.ndarray, clicked: np.ndarray) -> float:
    """The AUC of the true logits on these rows: no model scores better on them, in expectation."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(clicked, logit))


if __name__ == "__main__":  # python -m raylane.actors.click_log FOLDER ROWS
    if len(sys.argv) != 3:
        sys.exit("usage: python -m raylane.actors.click_log FOLDER ROWS")
    write_click_log(sys.argv[1], int(sys.argv[2]))
    print(f"wrote {int(sys.argv[2]):,} clicks to {sys.argv[1]}/")
