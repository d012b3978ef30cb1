"""The reference the pipeline_lm tests compare with: the same training in one process."""

from __future__ import annotations

import torch

from raylane.actors import corpus, gpt
from raylane.checkpoint import CheckpointStore
from raylane.jobs.pipeline_lm import PipelineLMConfig
from raylane.jobs.pipeline_state import layers_of


def reference(conf: PipelineLMConfig, steps: int) -> tuple[list[float], dict[str, dict]]:
    """The same training in one process: whole model, same batches, one AdamW per layer,
    each micro-batch's loss scaled by 1 / (micro-batches x replicas)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stages run (same kernels, same rounding)
    try:
        return _train(conf, steps)
    finally:
        torch.set_num_threads(threads)


def _train(conf: PipelineLMConfig, steps: int) -> tuple[list[float], dict[str, dict]]:
    ids, c, factory, _ = conf.inputs()  # the tokens, and the built-in model's shape or the user's factory
    tokens, _ = corpus.split(ids.ids, conf.val_fraction)
    layers = factory.build()[0] if factory is not None else gpt.build_layers(c)
    loss_fn = factory.loss() if factory is not None else gpt.loss_fn
    opts = [gpt.make_optimizer(layer, conf.lr, conf.weight_decay) for layer in layers]
    model = torch.nn.Sequential(*layers)
    losses = []
    for step in range(steps):
        total = 0.0
        for r in range(conf.replicas):
            x, y = corpus.batch(tokens, conf.micro_batches, conf.micro_batch_size, c.seq_len, seed=conf.seed, step=step, replica=r)
            for mb in range(conf.micro_batches):
                loss = loss_fn(model(torch.from_numpy(x[mb])), torch.from_numpy(y[mb]))
                (loss / (conf.micro_batches * conf.replicas)).backward()
                total += float(loss.detach())
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total / (conf.micro_batches * conf.replicas))
    return losses, {str(i): layer.state_dict() for i, layer in enumerate(layers)}


def final_params(run_dir) -> dict[str, dict]:
    _, state = CheckpointStore(str(run_dir / "checkpoints")).load_whole()
    return {i: st["params"] for i, st in layers_of(state["workload"]).items()}


def check_close(got: dict, want: dict, d_model: int) -> None:
    d = d_model  # the key bias is qkv.bias[d:2d]
    assert sorted(got, key=int) == sorted(want, key=int)
    for i in want:
        for k in want[i]:
            a, b = torch.as_tensor(got[i][k]), want[i][k]
            if k == "qkv.bias":
                # The key bias cannot change attention (softmax ignores a shift shared by a
                # query's scores): its true gradient is 0, and Adam turns the rounding noise
                # that stands in for it into steps of +-lr. Compare the query and value parts.
                a, b = torch.cat([a[:d], a[2 * d:]]), torch.cat([b[:d], b[2 * d:]])
            torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=lambda m: f"layer {i} {k}: {m}")
