"""Pipelined steps against the unsplit model on one process: same loss, gradients and
updated weights for every schedule, every dispatch mode and transport, recomputation, and 2 replicas."""

from __future__ import annotations

import pytest
import ray
import torch

from raylane.actors import pipeline_schedules as S
from raylane.actors import gpt
from raylane.actors.pipeline_stage import LinkedStage, PipelineStage, StageConfig, connect_linked, pieces_for, train_batch
from raylane.actors.pipeline_split import split_virtual

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = gpt.GPTConfig(vocab=32, seq_len=16, d_model=32, n_heads=2, n_blocks=4, seed=3)
M, B = 4, 2  # micro-batches, sequences per micro-batch
ATOL, RTOL = 2e-6, 1e-4


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, MODEL.vocab, (M, B, MODEL.seq_len + 1), generator=g)
    return data[..., :-1].contiguous(), data[..., 1:].contiguous()


def reference(batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: StageConfig):
    """One process, whole model: mean over replicas of the mean micro-batch loss."""
    layers = gpt.build_layers(MODEL)
    opts = [gpt.make_optimizer(layer, cfg.lr, cfg.weight_decay) for layer in layers]
    model = torch.nn.Sequential(*layers)
    losses = []
    for tokens, targets in batches:
        for mb in range(M):
            loss = gpt.loss_fn(model(tokens[mb]), targets[mb])
            (loss / (M * len(batches))).backward()
            losses.append(float(loss.detach()))
    grads = {str(i): [p.grad.clone() for p in layer.parameters()] for i, layer in enumerate(layers)}
    for opt in opts:
        opt.step()
    params = {str(i): {k: v.clone() for k, v in layer.state_dict().items()} for i, layer in enumerate(layers)}
    return losses, grads, params


CFG = StageConfig(MODEL, lr=1e-2, weight_decay=0.01)


@pytest.fixture(scope="module")
def stages(ray_local):
    out = {
        "driver": [PipelineStage.options(num_cpus=0.25).remote(CFG) for _ in range(4)],
        "linked": [LinkedStage.options(num_cpus=0.25).remote(CFG) for _ in range(4)],
        "gloo": [LinkedStage.options(num_cpus=0.25).remote(CFG) for _ in range(4)],
    }
    ray.get([h.__ray_ready__.remote() for hs in out.values() for h in hs], timeout=120)
    return out


def setup_pipelines(handles, sched: S.Schedule, replicas: int, transport: str | None):
    ranges = split_virtual([1.0] * MODEL.n_layers, [1.0] * sched.p, sched.v)
    pieces = pieces_for(sched, ranges)
    pipelines = [handles[r * sched.p:(r + 1) * sched.p] for r in range(replicas)]
    ray.get([h.load.remote(pieces[s], sched.virtual_stages - 1) for stages in pipelines for s, h in enumerate(stages)], timeout=60)
    if transport is not None:
        connect_linked(pipelines, transport, 60)
    return pipelines


MODES = {"driver": ("driver", None), "linked": ("linked", "ray"), "gloo": ("linked", "gloo")}  # mode -> (dispatch, transport)


def gathered(pipelines, method: str) -> dict:
    out: dict = {}
    for part in ray.get([getattr(h, method).remote() for h in pipelines[0]], timeout=60):
        out.update(part)
    return out


def check_close(got: dict, want: dict, what: str) -> None:
    assert sorted(got, key=int) == sorted(want, key=int)
    for i in want:
        for k, (a, b) in enumerate(zip(got[i] if isinstance(got[i], list) else got[i].values(), want[i] if isinstance(want[i], list) else want[i].values())):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} of layer {i} tensor {k}: {m}")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("bfs", 2)])
def test_pipelined_step_equals_the_unsplit_model(stages, mode, name, v):
    dispatch, transport = MODES[mode]
    sched = S.make(name, 2, M, v)
    pipelines = setup_pipelines(stages[mode], sched, replicas=1, transport=transport)
    data = batch(7)
    out = train_batch(pipelines, sched, [data], dispatch=dispatch, timeout_s=60, step=False)
    want_losses, want_grads, want_params = reference([data], CFG)
    assert out["losses"][0] == pytest.approx(want_losses, rel=1e-5)
    grads = gathered(pipelines, "grads")
    check_close(grads, want_grads, "gradient")
    ray.get([h.step.remote() for h in pipelines[0]], timeout=60)
    params = {i: st["params"] for i, st in gathered(pipelines, "state").items()}
    check_close(params, want_params, "updated weight")


@pytest.mark.parametrize("mode", list(MODES))
def test_recomputation_gives_the_same_step(ray_local, mode):
    dispatch, transport = MODES[mode]
    cfg = StageConfig(MODEL, lr=1e-2, weight_decay=0.01, recompute=True)
    cls = PipelineStage if dispatch == "driver" else LinkedStage
    handles = [cls.options(num_cpus=0.25).remote(cfg) for _ in range(2)]
    sched = S.make("1f1b", 2, M)
    pipelines = setup_pipelines(handles, sched, replicas=1, transport=transport)
    data = batch(11)
    out = train_batch(pipelines, sched, [data], dispatch=dispatch, timeout_s=60)
    want_losses, _, want_params = reference([data], cfg)
    assert out["losses"][0] == pytest.approx(want_losses, rel=1e-5)
    assert [s["peak_activations"] for s in out["steps"]] == [2, 1]  # 1f1b: p - s per stage
    params = {i: st["params"] for i, st in gathered(pipelines, "state").items()}
    check_close(params, want_params, "updated weight")
    for h in handles:
        ray.kill(h)


@pytest.mark.parametrize("mode", list(MODES))
def test_two_replicas_equal_single_process_data_parallel(stages, mode):
    dispatch, transport = MODES[mode]
    sched = S.make("interleaved", 2, M, 2)
    pipelines = setup_pipelines(stages[mode], sched, replicas=2, transport=transport)
    data = [batch(21), batch(22)]
    out = train_batch(pipelines, sched, data, dispatch=dispatch, timeout_s=60)
    want_losses, _, want_params = reference(data, CFG)
    assert out["losses"][0] + out["losses"][1] == pytest.approx(want_losses, rel=1e-5)
    assert all(s["replicas"] == 2 for s in out["steps"])
    for r in range(2):
        params = {i: st["params"] for i, st in gathered([pipelines[r]], "state").items()}
        check_close(params, want_params, f"replica {r} updated weight")


def test_gloo_links_refuse_a_micro_batch_whose_shape_changed(ray_local):
    handles = [LinkedStage.options(num_cpus=0.25).remote(CFG) for _ in range(2)]
    sched = S.make("1f1b", 2, M)
    pipelines = setup_pipelines(handles, sched, replicas=1, transport="gloo")
    first = batch(31)
    for _ in range(2):  # the first batch teaches both sides the shapes; the second uses them
        train_batch(pipelines, sched, [first], dispatch="linked", timeout_s=60)
    g = torch.Generator().manual_seed(5)
    wider = torch.randint(0, MODEL.vocab, (M, B + 1, MODEL.seq_len + 1), generator=g)
    with pytest.raises(Exception, match="must keep their shapes"):
        train_batch(pipelines, sched, [(wider[..., :-1], wider[..., 1:])], dispatch="linked", timeout_s=30)
    for h in handles:
        ray.kill(h)


def test_incoming_lists_what_each_stage_receives_in_the_order_it_takes_it():
    from raylane.actors.pipeline_stage import incoming

    sched = S.make("interleaved", 2, 2, 2)
    got = incoming(sched, 0)
    # stage 0 holds virtual stages 0 and 2: it receives F into 2 (from stage 1's vstage 1)
    # and B into 0 and 2 (from stage 1's vstages 1 and 3)
    assert sorted(src for src, _ in got) == [1] * len(got)
    assert len(got) == 2 * 2 + 2  # F into vstage 2 for 2 micro-batches, B into vstages 0 and 2
    assert len(set(tag for _, tag in got)) == len(got)
