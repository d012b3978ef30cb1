"""V-trace off-policy targets (Espeholt et al., 2018, IMPALA) and the staleness filter.

Pure numpy, tested without Ray against the paper's sum form and against GAE when the
behaviour and target policies are the same.

Rollouts are [T, N] fragments as the rollout workers make them. Episode ends are cut
the way :func:`raylane.actors.ppo_learner.gae` cuts them: where an episode *terminated*
at step t the value after it is 0, where it was *truncated* (a time limit) it is
V(final observation), and no trace crosses an episode end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VTrace:
    """V-trace's outputs for a [T, N] fragment."""

    vs: np.ndarray
    """Value targets v_s, [T, N]."""
    pg_advantages: np.ndarray
    """Policy-gradient advantages rho_s (r_s + gamma v_{s+1} - V(x_s)), [T, N]."""
    rhos: np.ndarray
    """Importance weights pi/mu before clipping, [T, N] (for metrics)."""


def vtrace(
    behaviour_logp_tn: np.ndarray,
    target_logp_tn: np.ndarray,
    rewards_tn: np.ndarray,
    values_tn: np.ndarray,
    terminated_tn: np.ndarray,
    truncated_tn: np.ndarray,
    final_values_tn: np.ndarray,
    last_values_n: np.ndarray,
    *,
    gamma: float,
    rho_clip: float = 1.0,
    c_clip: float = 1.0,
    lam: float = 1.0,
) -> VTrace:
    """V-trace targets by the backward recursion
    ``v_s - V(x_s) = delta_s + gamma c_s (v_{s+1} - V(x_{s+1}))`` with
    ``delta_s = rho_s (r_s + gamma V(x_{s+1}) - V(x_s))``, ``rho_s = min(rho_clip, pi/mu)``
    and ``c_s = lam min(c_clip, pi/mu)``. ``lam`` is the paper's section 4.2 variant
    (lam=1 is plain V-trace); with pi == mu it is GAE(lam)."""
    T = rewards_tn.shape[0]
    log_rhos = np.asarray(target_logp_tn, np.float64) - np.asarray(behaviour_logp_tn, np.float64)
    rhos = np.exp(np.minimum(log_rhos, 50.0))  # exp overflows past ~709; a ratio of e^50 is clipped anyway
    clipped_rhos = np.minimum(rho_clip, rhos)
    cs = lam * np.minimum(c_clip, rhos)
    values = np.asarray(values_tn, np.float64)
    done = np.asarray(terminated_tn, bool) | np.asarray(truncated_tn, bool)
    # The value after step t: V(x_{t+1}) inside an episode, else 0 / V(final obs).
    following = np.concatenate([values[1:], np.asarray(last_values_n, np.float64)[None]], axis=0)
    boot_at_end = np.where(np.asarray(terminated_tn, bool), 0.0, np.asarray(final_values_tn, np.float64))
    next_values = np.where(done, boot_at_end, following)
    deltas = clipped_rhos * (np.asarray(rewards_tn, np.float64) + gamma * next_values - values)
    vs_minus_v = np.zeros_like(values)
    acc = np.zeros(values.shape[1])
    for t in reversed(range(T)):
        acc = deltas[t] + gamma * cs[t] * np.where(done[t], 0.0, acc)
        vs_minus_v[t] = acc
    vs = vs_minus_v + values
    # v_{s+1}: the next target inside an episode; the bootstrap value where it ended or
    # at the fragment's end (no target exists beyond the fragment).
    vs_next = np.concatenate([vs[1:], np.asarray(last_values_n, np.float64)[None]], axis=0)
    vs_next = np.where(done, boot_at_end, vs_next)
    pg_adv = clipped_rhos * (np.asarray(rewards_tn, np.float64) + gamma * vs_next - values)
    return VTrace(vs.astype(np.float32), pg_adv.astype(np.float32), rhos.astype(np.float32))


def split_stale(versions: list[int], current: int, bound: int) -> tuple[list[int], list[int]]:
    """Indices of the fragments to keep and to drop: a fragment made by policy version v
    is ``current - v`` versions old and is dropped when that exceeds ``bound``. A version
    newer than ``current`` (made after a learner was restored from an older checkpoint)
    counts as stale too: its behaviour policy no longer exists."""
    keep, drop = [], []
    for i, v in enumerate(versions):
        (keep if 0 <= current - v <= bound else drop).append(i)
    return keep, drop
