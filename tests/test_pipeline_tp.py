"""Pipeline parallelism over tensor-parallel stages (TP2 x PP2, 4 ranks) against one process.

* The executor takes the loss from the last stage (the vocab-parallel cross-entropy
  on its (B/m, T, V_pad / tp) logits) and sizes every message from the stage's
  actual output ((B/m, T / tp, C) under sequence parallelism): loss and gradients
  equal those of the plain GPT on the full batch, with and without SP, for 1F1B
  and interleaved 1F1B.
* Activation checkpointing with dropout: the recomputed forward replays every
  random stream, the TP stream of the sharded regions included, so the gradients
  equal those of the run that kept its activations, and the streams end where
  that run left them.
* Under bf16 autocast, a stage that hands on bf16 activations sends and receives
  bf16 (half the bytes) and matches the same computation in one process.
"""

import torch

from reference import comms
from reference.mesh import Mesh
from reference.model import GPT, GPTConfig, lm_loss
from reference.runtime import launch
from reference.tensor_parallel import (
    allreduce_sequence_parallel_grads, apply_tensor_parallel, column_shard, padded_vocab_size,
    row_shard, vocab_parallel_cross_entropy,
)
from reference.tolerance import exact, gradient, loss
from reference.train.single import accumulate_gradients

# 251 is prime: padded to 252 over tp = 2. T = 8 splits over tp; 4 blocks make 2
# stages, or 4 for the interleaved schedule (2 chunks per rank).
CFG = GPTConfig.tiny(vocab_size=251, block_size=8, n_layer=4)
B, T, M = 4, 8, 2
# fp32: the same sums in another order (reference.tolerance). Gradients: summed over M
# micro-batches and over 2 ranks (tp for SP's LayerNorms, pp for the tied embedding).
LOSS_TOL, GRAD_TOL = loss(), gradient(2 * M)


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, CFG.vocab_size, (B, T), generator=g),
            torch.randint(0, CFG.vocab_size, (B, T), generator=g))


def _dense_shard(name, t, r, n):
    """This rank's part of the dense tensor `t` that TP parameter `name` holds."""
    if name in ("wte.weight", "lm_head.weight"):
        padded = torch.cat([t, t.new_zeros(padded_vocab_size(CFG.vocab_size, n) - CFG.vocab_size,
                                           t.shape[1])])
        return padded.chunk(n, dim=0)[r]
    if ".c_attn." in name:
        return column_shard(t, r, n, chunks=3)
    if ".c_fc." in name:
        return column_shard(t, r, n)
    if name.endswith("c_proj.weight"):
        return row_shard(t, r, n)
    return t  # replicated: positions, LayerNorms, row-parallel biases


def _setup():
    from reference.pipeline_parallel import build_embedding_group

    mesh = Mesh(pp=2, tp=2).build_groups()
    return mesh, build_embedding_group(mesh)


def _tp_stages(mesh, cfg, sp, virtual=1, seed=5):
    from reference.pipeline_parallel import local_stages, split_stages

    model = apply_tensor_parallel(GPT.from_config_seed(cfg, 0), mesh, sequence_parallel=sp, seed=seed)
    return model, local_stages(split_stages(model, mesh.pp, virtual), mesh.pp, mesh.pp_rank)


def _finish_grads(stages, mesh, sp):
    if sp:  # LayerNorms and row-parallel biases saw only this rank's tokens
        for st in stages:
            allreduce_sequence_parallel_grads(st, mesh.group("tp"))
    return {n: p.grad.clone() for st in stages for n, p in st.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------
# Loss and gradients equal one process, with and without sequence parallelism
# ---------------------------------------------------------------------------
def _parity_body():
    from reference.pipeline_parallel import build_schedule, run_pipeline

    mesh, tied = _setup()
    r, n = mesh.tp_rank, mesh.tp
    x, y = _batch()
    dense = GPT.from_config_seed(CFG, 0)
    loss_d = accumulate_gradients(dense, x, y)  # one process, the full batch
    dense_grads = {k: p.grad for k, p in dense.named_parameters(remove_duplicate=False)}
    checked = []
    for sp in (False, True):
        for kind, virtual in (("1f1b", 1), ("interleaved", 2)):
            what = f"sp={sp} {kind}"
            _, stages = _tp_stages(mesh, CFG, sp, virtual)
            result = run_pipeline(build_schedule(kind, mesh.pp, M, virtual), stages, x, y,
                                  group=mesh.pp_group, tied_group=tied)
            if mesh.pp_rank == mesh.pp - 1:
                LOSS_TOL.assert_close(result.loss, loss_d, f"{what} loss")
            grads = _finish_grads(stages, mesh, sp)
            assert grads, what
            for name, g in grads.items():
                GRAD_TOL.assert_close(g, _dense_shard(name, dense_grads[name], r, n), f"{what} grad of {name}")
            checked.append((what, len(grads)))
    return checked


def test_tp_pp_equals_one_process_with_and_without_sp():
    results = launch(_parity_body, 4, timeout=120.0, quiet=True, threads=1)
    assert all(len(checked) == 4 and all(k > 0 for _, k in checked) for checked in results)


# ---------------------------------------------------------------------------
# Checkpointed recomputation replays the TP dropout stream
# ---------------------------------------------------------------------------
def _recompute_body():
    from reference.pipeline_parallel import build_schedule, run_pipeline

    mesh, tied = _setup()
    x, y = _batch()
    group = mesh.group("tp")

    def loss_fn(logits, targets, reduction="mean"):  # given explicitly: this test is about the recomputation alone
        return vocab_parallel_cross_entropy(logits, targets, group, CFG.vocab_size, reduction=reduction)

    for sp in (False, True):
        runs = {}
        for p_drop, checkpoint in ((0.2, False), (0.2, True), (0.0, False)):
            torch.manual_seed(123)  # the replicated stream: the same on every rank, in both runs
            model, stages = _tp_stages(mesh, GPTConfig.tiny(vocab_size=251, block_size=8, n_layer=4,
                                                            dropout=p_drop), sp)
            result = run_pipeline(build_schedule("1f1b", mesh.pp, M), stages, x, y, group=mesh.pp_group,
                                  tied_group=tied, checkpoint=checkpoint, loss_fn=loss_fn)
            cpu_state = torch.get_rng_state()
            with model.tp_rng.fork():  # where the TP stream stands: its next draws
                tp_next = torch.rand(8)
            runs[p_drop, checkpoint] = (result.loss, _finish_grads(stages, mesh, sp), cpu_state, tp_next)
        (loss_kept, grads_kept, cpu_kept, tp_kept), (loss_ckpt, grads_ckpt, cpu_ckpt, tp_ckpt) = \
            runs[0.2, False], runs[0.2, True]
        what = f"sp={sp}"
        # Recomputing replays the same masks and the same arithmetic in the same order.
        if mesh.pp_rank == mesh.pp - 1:
            exact().assert_close(loss_ckpt, loss_kept, f"{what} checkpointed loss")
        # The control: dropout does change the gradients (by far more than the tolerance).
        no_dropout = runs[0.0, False][1]
        assert any(not GRAD_TOL.close(g, no_dropout[k]) for k, g in grads_kept.items()), what
        assert grads_ckpt.keys() == grads_kept.keys()
        for name, g in grads_ckpt.items():
            exact().assert_close(g, grads_kept[name], f"{what} checkpointed grad of {name}")
        assert torch.equal(cpu_ckpt, cpu_kept), f"{what}: the default stream must end where it did"
        assert torch.equal(tp_ckpt, tp_kept), f"{what}: the TP stream must end where it did"
    return "ok"


def test_checkpoint_recompute_replays_tensor_parallel_dropout():
    assert launch(_recompute_body, 4, timeout=120.0, quiet=True, threads=1) == ["ok"] * 4


# ---------------------------------------------------------------------------
# bf16 activations between stages under autocast
# ---------------------------------------------------------------------------
class Bf16Boundary(torch.nn.Module):
    """A stage that hands on its activation in bf16 (half the bytes on the wire)."""

    def __init__(self, stage):
        super().__init__()
        self.stage, self.spec, self.config = stage, stage.spec, stage.config

    def forward(self, x):
        out, aux = self.stage(x)
        return (out if self.spec.head else out.to(torch.bfloat16)), aux

    def loss(self, logits, targets, reduction="mean"):
        return self.stage.loss(logits, targets, reduction)


# bf16 keeps 8 significant bits: each rounding is off by up to 2^-8 = 0.4% of the
# value. TP rounds the row-parallel partial sums to bf16 before adding them, one
# process rounds the whole sum once, so the two runs differ by a few roundings per
# block. The course's bf16 bounds (reference.tolerance): the loss `loss(torch.bfloat16)`,
# each gradient `gradient(2 M, torch.bfloat16)` for values of the size of its largest
# entry (summed over M micro-batches and 2 ranks, as in fp32); a wrong message (a shape
# or dtype mix-up) or a missing reduction is off by the whole gradient.
BF16_LOSS, BF16_GRAD = loss(torch.bfloat16), gradient(2 * M, torch.bfloat16)


def _bf16_body():
    from reference.pipeline_parallel import (build_schedule, run_pipeline, split_stages,
                                             sync_tied_grads)

    mesh, tied = _setup()
    r, n = mesh.tp_rank, mesh.tp
    x, y = _batch()
    # One process: the same computation (bf16 handed from the first stage to the second).
    dense = GPT.from_config_seed(CFG, 0)
    first, last = split_stages(dense, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = last(first(x)[0].to(torch.bfloat16))
        loss_d = lm_loss(logits, y)
    loss_d.backward()
    dense_grads = {k: p.grad for k, p in dense.named_parameters(remove_duplicate=False)}

    _, stages = _tp_stages(mesh, CFG, sp=True)
    with comms.meter() as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        result = run_pipeline(build_schedule("1f1b", mesh.pp, M), [Bf16Boundary(s) for s in stages],
                              x, y, group=mesh.pp_group)
    sync_tied_grads(stages, tied)
    act_bytes = (B // M) * (T // n) * CFG.n_embd * 2  # (B/m, T/tp, C) in bf16
    op = "send" if mesh.pp_rank == 0 else "recv"
    assert (meter.calls(op, "pp"), meter.payload_bytes(op, "pp")) == (M, M * act_bytes), meter.records()
    # one handshake, with micro-batch 0's activation: 8 int64
    assert (meter.calls(op + "_meta", "pp"), meter.payload_bytes(op + "_meta", "pp")) == (1, 64)
    loss_error = None
    if mesh.pp_rank == mesh.pp - 1:
        loss_error = abs(result.loss.item() - loss_d.item()) / loss_d.item()
        BF16_LOSS.assert_close(result.loss, loss_d, "bf16 loss")
    worst = 0.0
    for name, g in _finish_grads(stages, mesh, sp=True).items():
        expected = _dense_shard(name, dense_grads[name], r, n)
        scale = expected.abs().max().item()
        BF16_GRAD.at_scale(scale).assert_close(g, expected, f"bf16 grad of {name}")
        worst = max(worst, (g - expected).abs().max().item() / scale)
    return loss_error, worst


def test_bf16_autocast_stages_send_bf16_and_match_one_process():
    launch(_bf16_body, 4, timeout=120.0, quiet=True, threads=1)
