"""The single-process training loop: the run every parallel version is compared with.

`accumulated_step` is the oracle of every parity check (the tests, the golden losses, the
trainer's `parity` command, the all-pairs sweep): one process, the global batch in the parallel
run's dp x micro-batch chunks, its precision, loss scaler and clipping. `train_step` and `train`
are the plain loop of the first notebooks: AdamW on reproducible batches (`reference.data.get_batch`).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from reference.data import ByteCorpus, get_batch
from reference.loss import step_mean
from reference.model import autocast, lm_loss, weight_decay_groups

# One chunk's (loss, auxiliary loss) from (model, x, y): `accumulate_gradients`' loss_fn.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Union[torch.Tensor, float]]]

__all__ = ["make_optimizer", "train_step", "accumulate_gradients", "accumulated_step", "evaluate", "train"]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad: one group without decay, else two, with
    only the matrices (dim >= 2) decayed and not the biases and LayerNorm gains, as in nanoGPT."""
    groups = weight_decay_groups([p for p in model.parameters() if p.requires_grad], weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               grad_clip: Optional[float] = None, mesh=None) -> float:
    """One optimizer step on (x, y); returns the loss (LM loss + aux losses). ``grad_clip`` clips
    the gradients' norm; inside a parallel run each rank holds only part of the gradients, so pass
    the run's ``mesh`` and the global norm is used (`reference.parallel.clip`)."""
    _, loss = model(x, y)
    loss.backward()
    if grad_clip is not None:
        _clip(model, grad_clip, mesh)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # frees the gradients' memory between steps
    return loss.item()


def _clip(model: nn.Module, max_norm: float, mesh) -> None:
    if mesh is None:
        import torch.distributed as dist  # only asked, never used to communicate here

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"grad_clip={max_norm} inside a run of {dist.get_world_size()} ranks: each rank "
                f"would clip by the norm of its own gradients only; pass mesh= (the run's "
                f"reference.mesh.Mesh) so the norm is taken over the whole model")
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    from reference.parallel.clip import clip_grad_norm_  # the composing layer, loaded only here

    clip_grad_norm_(model, max_norm, mesh)


def accumulate_gradients(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, chunks: int = 1,
                         *, precision: str = "fp32", loss_scale: float = 1.0,
                         loss_mean: str = "tokens", loss_fn: Optional[LossFn] = None) -> float:
    """The oracle's forward and backward: the global batch in ``chunks`` equal chunks of rows
    (dp x micro-batches), gradients adding up in ``.grad``, autocast for bf16 and fp16. Each chunk
    backpropagates its share of the loss times ``loss_scale`` (`reference.loss`): "tokens", its
    sum over counted tokens / the whole batch's count (``F.cross_entropy`` of the whole batch,
    whatever the chunks); "mean_of_means", its own mean / ``chunks``; plus its aux loss / ``chunks``.

    A GPT runs through the pipeline executor as one stage (`run_schedule` at pp = 1: F0 B0 F1
    B1 ...), the loop every parallel run uses, so the loss is built where theirs is.
    ``loss_fn(model, x, y) -> (mean loss, aux)`` replaces the GPT's forward and LM loss (a toy
    model, a lone MoE layer): each chunk backpropagates (loss + aux) / chunks. Returns the loss."""
    # loaded here: `import reference.train` stays light for the first notebooks
    from reference.pipeline_parallel import build_schedule, split_stages
    from reference.pipeline_parallel.executor import run_schedule

    if loss_fn is None:
        whole = split_stages(model, 1)[0]  # the GPT's own modules as one stage: (logits, aux)
        with autocast(precision, idx.device.type):  # the composed step's too
            loss = run_schedule(build_schedule("1f1b", 1, chunks), [whole], idx, targets, loss_scale=loss_scale,
                                loss_mean=step_mean(loss_mean, targets, chunks, replicas=1))
        return float(loss)
    shares = []  # a model of its own: its loss_fn's mean, the executor's `MeanOfMeans` by hand
    for x, y in zip(idx.chunk(chunks), targets.chunk(chunks)):
        with autocast(precision, x.device.type):
            loss, aux = loss_fn(model, x, y)
            share = loss / chunks
        ((share + aux / chunks) * loss_scale).backward()
        shares.append(share.detach().float())
    return float(torch.stack(shares).sum())


def accumulated_step(model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor,
                     targets: torch.Tensor, chunks: int = 1, *, precision: str = "fp32",
                     scaler=None, max_norm: Optional[float] = None,
                     loss_mean: str = "tokens", loss_fn: Optional[LossFn] = None) -> tuple[float, bool]:
    """The oracle's step: `accumulate_gradients`; with fp16's ``scaler`` (`DynamicLossScaler`)
    unscaled, a step with an inf or NaN skipped; clipped at ``max_norm``; the optimizer's step.
    Returns (loss, skipped); the step's gradients stay in ``.grad`` until the next call."""
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients(model, idx, targets, chunks, precision=precision,
                                loss_scale=scaler.scale if scaler is not None else 1.0,
                                loss_mean=loss_mean, loss_fn=loss_fn)
    if scaler is not None:
        overflow = scaler.unscale_and_check([p.grad for p in model.parameters() if p.grad is not None])
        scaler.update(overflow)
        if overflow:
            return loss, True
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    for router in (m for m in model.modules() if getattr(m, "expert_bias", None) is not None):
        router.move_bias(router.step_tokens_per_expert)  # experts balanced by a bias: the step's loads
    optimizer.step()
    return loss, False


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int, num_batches: int = 4,
             seed: int = 0) -> float:
    """Mean LM loss (no aux losses) over ``num_batches`` fixed batches of ``data``, in eval mode."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = []
    for i in range(num_batches):
        x, y = get_batch(data, batch_size, model.config.block_size, step=i, seed=seed, device=device)
        logits, _ = model(x)
        losses.append(lm_loss(logits, y).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def train(model: nn.Module, steps: int, batch_size: int, lr: float = 1e-3,
          data: Optional[Union[ByteCorpus, torch.Tensor]] = None, seed: int = 0, progress: bool = True,
          eval_every: int = 0, on_eval: Optional[Callable[[int, float], None]] = None,
          weight_decay: float = 0.0, grad_clip: Optional[float] = None) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps on ``data`` (a `ByteCorpus`, by default
    ``ByteCorpus.load()``, or a 1-D tensor of tokens); returns every step's loss. Batches and dropout
    follow ``seed``: the same arguments give the same losses. With ``eval_every`` the validation
    loss (`evaluate`) goes to the progress bar and to ``on_eval(step, val_loss)``."""
    if steps < 0 or batch_size <= 0:
        raise ValueError(f"steps={steps} must be >= 0 and batch_size={batch_size} positive")
    if data is None:
        data = ByteCorpus.load()
    train_data, val_data = (data.train, data.val) if isinstance(data, ByteCorpus) else (data, None)
    if eval_every > 0 and val_data is None:
        raise ValueError("eval_every > 0 needs validation data: pass a ByteCorpus as data")

    device = next(model.parameters()).device
    block_size = model.config.block_size
    optimizer = make_optimizer(model, lr, weight_decay=weight_decay)
    losses: list[float] = []
    model.train()
    # dropout draws from the device's global RNG: seeded here, the caller's state given back after
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        bar = tqdm(range(steps), disable=not progress, desc="train", leave=True)
        postfix = {}
        for step in bar:
            x, y = get_batch(train_data, batch_size, block_size, step=step, seed=seed, device=device)
            losses.append(train_step(model, optimizer, x, y, grad_clip))
            postfix["loss"] = f"{losses[-1]:.3f}"
            last = step == steps - 1
            if eval_every > 0 and ((step + 1) % eval_every == 0 or last):
                val_loss = evaluate(model, val_data, batch_size, seed=seed)
                postfix["val"] = f"{val_loss:.3f}"
                if on_eval is not None:
                    on_eval(step, val_loss)
            bar.set_postfix(postfix, refresh=False)
        bar.close()
    return losses
