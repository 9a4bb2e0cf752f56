"""The course on GPUs: NCCL with one GPU per rank, models on CUDA, bf16 autocast.

Skipped, with the reason, on a machine without CUDA GPUs.

* One GPU: each wrapper at world size 1 on CUDA (DDP, ZeRO-1/2, FSDP, tensor, pipeline
  and expert parallelism, the global gradient clip) against the same model trained
  plainly on the same GPU; the bf16 autocast paths; DDP's trace timed with CUDA events.
* Two GPUs or more: the parity tests of DDP (test_data_parallel's own rank bodies and
  checks), ZeRO-1/2/3, TP (+SP), PP and EP on NCCL, and the global clip (test_clip's
  bodies and checks), against the CPU tests' single-process oracles; the lecture
  notebooks 00-05, headless.

Tolerances: the course's policy (`reference.tolerance`), as on the CPU. cuBLAS and the CPU's
BLAS add a matmul's products in other orders (cuBLAS picks its kernel by shape, so a rank's
B/N rows and one process's B rows round differently): the same sums in another order, which
is what the policy's fp32 bounds are about; TF32 stays off. Outputs `forward()`, losses
`loss()`, gradients summed over ranks `gradient(n)`, weights after AdamW steps
`adamw_weights(steps, lr)`: a gradient that is pure rounding noise (such as the key bias's)
is normalised by Adam into a step of up to lr in a direction the noise sets, and GPU noise is
not CPU noise, which the bound on any one weight allows; the means are the check.
"""
import copy
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference import runtime
from reference.runtime import device, launch
from reference.tolerance import adamw_weights, exact, forward, loss

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(
    gpus < 1, reason=f"needs a CUDA GPU (torch.cuda.is_available() is {torch.cuda.is_available()}, "
                     f"{gpus} devices)")
needs_two_gpus = pytest.mark.skipif(
    gpus < 2, reason=f"NCCL with one GPU per rank needs 2 CUDA GPUs, found {gpus}")

TOL, LOSS = forward(), loss()
# bf16 keeps 8 significant bits: a loss near 5.5 is rounded to 2**-5 (tests/test_zero.py
# measures bf16 losses within 0.051 of fp32 on this model); 0.1 allows for that.
BF16_LOSS = 0.1
TIMEOUT = 300


def _fp32_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 parity the tolerances assume
    torch.backends.cudnn.allow_tf32 = False


def _cpu(named):
    return {n: t.detach().cpu().clone() for n, t in named}


def _close(got, want, what, tol):
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def _all_close(got: dict, want: dict, what, tol):
    assert got.keys() == want.keys(), what
    for name in want:
        _close(got[name], want[name], f"{what}, {name}", tol)


def _both_kinds_of_tensor():
    dev = runtime.device()
    on_gpu = torch.ones(4, device=dev) * (dist.get_rank() + 1)
    on_cpu = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(on_gpu)   # NCCL
    dist.all_reduce(on_cpu)   # gloo: CPU tensors keep working under NCCL
    return str(dev), str(dist.get_backend()), on_gpu.cpu(), on_cpu


@needs_gpu
def test_nccl_with_one_gpu_per_rank():
    world = min(gpus, 2)
    results = launch(_both_kinds_of_tensor, world, backend="auto", quiet=True, timeout=120)
    expected = torch.full((4,), world * (world + 1) / 2)
    for rank, (dev, backend, g, c) in enumerate(results):
        assert dev == f"cuda:{rank}"
        assert "nccl" in backend
        exact().assert_close(g, expected, "NCCL all-reduce")
        exact().assert_close(c, expected, "gloo all-reduce")


@needs_gpu
def test_launch_after_the_caller_used_cuda():
    """The fork server never touched CUDA, so ranks can use it whatever the caller did."""
    torch.ones(1, device="cuda").sum().item()
    assert launch(lambda: str(runtime.device()), 1, backend="nccl", quiet=True) == ["cuda:0"]


@needs_gpu
def test_fork_refuses_once_cuda_is_initialised():
    import subprocess
    import sys

    code = ("import torch; from reference import runtime\n"
            "torch.ones(1, device='cuda')\n"
            "try:\n    runtime.resolve_backend('auto', 1, start_method='fork')\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused: CUDA is already initialised" in out.stdout, out.stderr


# =================================================================== one GPU, world size 1
def _one_gpu_body():
    from reference.data import synthetic_batch
    from reference.data_parallel import DDP
    from reference.model import GPT, GPTConfig
    from reference.zero import FSDP, ZeroOptimizer

    _fp32_matmuls()
    dev = device()
    cfg = GPTConfig.tiny()
    batches = [tuple(t.to(dev) for t in synthetic_batch(8, 16, seed=0, step=s)) for s in range(3)]

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)

    def plain(m):
        return m, adamw(m.parameters())

    def ddp(m):
        return DDP(m), adamw(m.parameters())

    def zero(stage):
        return lambda m: (m, ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3, eps=1e-6))

    def fsdp(**options):
        def make(m):
            f = FSDP(m, **options)
            return f, adamw(f.parameters())
        return make

    def run(make, bf16=False):
        model = GPT.from_config_seed(cfg, 0).to(dev)
        runner, opt = make(model)
        losses = []
        for x, y in batches:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                _, loss = runner(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        params = runner.full_state_dict() if isinstance(runner, FSDP) else _cpu(model.named_parameters())
        return dict(losses=losses, params=params)

    out = {name: run(make) for name, make in (("plain", plain), ("ddp", ddp), ("zero1", zero(1)),
                                              ("zero2", zero(2)), ("fsdp", fsdp()))}
    out["plain bf16"], out["ddp bf16"] = run(plain, bf16=True), run(ddp, bf16=True)
    out["fsdp mixed precision"] = run(fsdp(mixed_precision=True))
    out.update(_one_gpu_trace(cfg, batches))
    out.update(_one_gpu_parallelisms(cfg, batches))
    return out


def _one_gpu_trace(cfg, batches):
    """DDP's trace on CUDA: events resolved into perf_counter seconds within the step."""
    from reference.data_parallel import DDP
    from reference.model import GPT

    ddp = DDP(GPT.from_config_seed(cfg, 0).to(device()), bucket_cap_mb=4096 / 2**20)
    start = time.perf_counter()
    ddp(*batches[0])[1].backward()
    end = time.perf_counter()
    return {"trace": dict(trace=ddp.trace, window=(start, end), n_buckets=len(ddp.buckets),
                          on_gpu=ddp._clock.on_gpu)}


def _one_gpu_parallelisms(cfg, batches):
    """TP, PP and EP of degree 1 on CUDA, and the global clip, against the plain model's gradients."""
    from reference.expert_parallel import ExpertParallelMoE, MoE
    from reference.mesh import Mesh
    from reference.model import GPT
    from reference.parallel.clip import clip_grad_norm_
    from reference.pipeline_parallel import build_schedule, run_pipeline, split_stages
    from reference.tensor_parallel import apply_tensor_parallel

    dev, mesh = device(), Mesh().build_groups()
    x, y = batches[0]
    plain = GPT.from_config_seed(cfg, 0).to(dev)
    plain(x, y)[1].backward()
    out = {"plain grads": {n: p.grad.cpu().clone() for n, p in plain.named_parameters()}}
    tp = apply_tensor_parallel(GPT.from_config_seed(cfg, 0).to(dev), mesh, sequence_parallel=True)
    tp(x, y)[1].backward()
    out["tp grads"] = {n: p.grad.cpu().clone() for n, p in tp.named_parameters()}
    stages = split_stages(GPT.from_config_seed(cfg, 0).to(dev), 1)
    run_pipeline(build_schedule("1f1b", 1, 2), stages, x, y)
    out["pp grads"] = {n: p.grad.cpu().clone() for n, p in stages[0].named_parameters()}
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, k=2, capacity_factor=None).to(dev)
    ep = ExpertParallelMoE.from_dense(copy.deepcopy(moe), mesh.ep_group)  # all 4 experts here
    h = torch.randn(2, 8, 16, device=dev)
    out["ep"] = [(m(h)[0].detach().cpu()) for m in (moe, ep)]
    norm = clip_grad_norm_(plain, 0.05, mesh)
    torch_model = GPT.from_config_seed(cfg, 0).to(dev)
    torch_model(x, y)[1].backward()
    out["clip"] = (norm.cpu(), torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 0.05).cpu(),
                   {n: p.grad.cpu().clone() for n, p in plain.named_parameters()},
                   {n: p.grad.cpu().clone() for n, p in torch_model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def one_gpu():
    return launch(_one_gpu_body, 1, backend="nccl", timeout=TIMEOUT, quiet=True)[0]


@needs_gpu
@pytest.mark.parametrize("wrapper", ["ddp", "zero1", "zero2", "fsdp"])
def test_each_wrapper_at_world_size_one_on_cuda(one_gpu, wrapper):
    got, want = one_gpu[wrapper], one_gpu["plain"]
    LOSS.assert_losses(got["losses"], want["losses"], f"{wrapper} losses")
    assert got["params"].keys() == want["params"].keys()
    adamw_weights(3, 1e-3).assert_weights(got["params"], want["params"], f"{wrapper} parameters after 3 steps")


@needs_gpu
def test_bf16_autocast_on_cuda(one_gpu):
    fp32 = one_gpu["plain"]["losses"]
    for variant in ("plain bf16", "ddp bf16", "fsdp mixed precision"):
        bf16 = one_gpu[variant]["losses"]
        assert all(abs(a - b) < BF16_LOSS for a, b in zip(fp32, bf16)), (variant, fp32, bf16)
        assert bf16 != fp32, f"{variant} did not compute in bf16"
    # DDP under autocast is the plain model under autocast (world size 1: the mean is the gradient).
    adamw_weights(3, 1e-3, dtype=torch.bfloat16).assert_weights(
        one_gpu["ddp bf16"]["params"], one_gpu["plain bf16"]["params"], "DDP bf16")


@needs_gpu
def test_ddp_trace_reads_cuda_events(one_gpu):
    out = one_gpu["trace"]
    assert out["on_gpu"]
    start, end = out["window"]
    times = {}
    for e in out["trace"]:
        assert type(e["time"]) is float and start <= e["time"] <= end, e
        times.setdefault(e["event"], {})[e["bucket"]] = e["time"]
    launches = [times["launch"][i] for i in range(out["n_buckets"])]
    assert times["forward_end"][None] <= launches[0] and launches == sorted(launches)
    for i in range(out["n_buckets"]):  # each all-reduce ends after backward and after its launch
        assert times["backward_end"][None] <= times["wait_start"][i] <= times["wait_end"][i]
        assert launches[i] <= times["wait_end"][i]


@needs_gpu
def test_parallelisms_of_degree_one_and_the_clip_on_cuda(one_gpu):
    plain = one_gpu["plain grads"]
    _all_close(one_gpu["pp grads"], plain, "PP (pp = 1) gradients", TOL)
    _all_close(one_gpu["tp grads"], plain, "TP (tp = 1) gradients", TOL)
    moe_out, ep_out = one_gpu["ep"]
    _close(ep_out, moe_out, "EP (ep = 1) output", TOL)
    norm, torch_norm, grads, torch_grads = one_gpu["clip"]
    assert norm > 0.05  # clipping happened
    _close(norm, torch_norm, "global norm", TOL)
    _all_close(grads, torch_grads, "clipped gradients", TOL)


# ================================================================ two GPUs, NCCL
def _launch_nccl(body, *args):
    return launch(body, 2, *args, backend="nccl", timeout=TIMEOUT, quiet=True)


@pytest.fixture(scope="module")
def ddp_nccl():
    import test_data_parallel as t

    return 2, _launch_nccl(t._all_checks)


@needs_two_gpus
@pytest.mark.parametrize("check", ["parity", "against_torch", "no_sync", "tied_frozen", "unused",
                                   "overlap", "bucket_cap_zero", "device"])
def test_ddp_on_nccl(ddp_nccl, check):
    """test_data_parallel's rank bodies (models and batches on device()) and its checks."""
    import test_data_parallel as t

    fn = getattr(t, f"check_{check}")  # with the checks' own tolerances
    if check == "unused":  # launches after backward may share its event's timestamp on a GPU
        fn(*ddp_nccl, timing=False)
    else:
        fn(*ddp_nccl)


def _zero_nccl_body():
    import test_zero as z
    from reference.zero import FSDP

    _fp32_matmuls()
    r, n, dev = dist.get_rank(), dist.get_world_size(), device()
    out = {}
    for variant, make in (("zero1", z._zero(1)), ("zero2", z._zero(2)), ("fsdp", z._fsdp())):
        for name in ("even", "uneven"):
            model = z._model(name).to(dev)
            runner, optim = make(model, "adamw")
            for step in range(z.STEPS):
                _, loss = runner(*(t.to(dev) for t in z._batch(step, r, n)))
                loss.backward()
                optim.step()
                optim.zero_grad()
            out[name, variant] = (runner.full_state_dict() if isinstance(runner, FSDP)
                                  else _cpu(model.named_parameters()))
    return out


@needs_two_gpus
def test_zero_1_2_3_on_nccl():
    import test_zero as z

    results = _launch_nccl(_zero_nccl_body)
    for name in ("even", "uneven"):
        oracle = z._single_process(name)
        for rank, out in enumerate(results):
            for variant in ("zero1", "zero2", "fsdp"):
                assert out[name, variant].keys() == oracle.keys()
                z.TOL.assert_weights(out[name, variant], oracle, f"rank {rank} {name} {variant}")


def _tp_nccl_body():
    import test_tensor_parallel_gpt as t
    from reference.mesh import Mesh
    from reference.model import GPT
    from reference.tensor_parallel import allreduce_sequence_parallel_grads, apply_tensor_parallel
    from reference.train import make_optimizer

    _fp32_matmuls()
    mesh, dev, out = Mesh(tp=2).build_groups(), device(), {}
    for sp in (False, True):
        model = apply_tensor_parallel(GPT.from_config_seed(t.CFG, 0).to(dev), mesh, sequence_parallel=sp)
        opt, losses = make_optimizer(model, lr=t.LR), []
        for x, y in t._batches(3):
            _, loss = model(x.to(dev), y.to(dev))
            loss.backward()
            if sp:
                allreduce_sequence_parallel_grads(model, mesh.tp_group)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[sp] = losses, _cpu(model.named_parameters())
    return out


@needs_two_gpus
def test_tensor_parallel_with_and_without_sp_on_nccl():
    import test_tensor_parallel_gpt as t
    from reference.model import GPT
    from reference.train import make_optimizer
    from reference.train.single import accumulated_step

    dense = GPT.from_config_seed(t.CFG, 0)
    opt = make_optimizer(dense, lr=t.LR)
    losses = [accumulated_step(dense, opt, x, y)[0] for x, y in t._batches(3)]
    want = dict(dense.named_parameters())
    for rank, out in enumerate(_launch_nccl(_tp_nccl_body)):
        for sp, (got_losses, params) in out.items():
            LOSS.assert_losses(got_losses, losses, f"rank {rank} sp={sp} losses")
            shards = {name: t.dense_shard(name, want[name].detach(), rank, 2) for name in params}
            adamw_weights(3, t.LR).assert_weights(params, shards, f"rank {rank} sp={sp}")


def _pp_nccl_body():
    import test_pipeline_parity as pt
    from reference.data import synthetic_batch
    from reference.mesh import Mesh
    from reference.pipeline_parallel import build_embedding_group, build_schedule, local_stages, run_pipeline, split_stages

    _fp32_matmuls()
    mesh, dev, out = Mesh(pp=2).build_groups(), device(), {}
    tied = build_embedding_group(mesh)
    for kind, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        model = pt._model(tied=True, frozen=False).to(dev)
        stages = local_stages(split_stages(model, 2, virtual), 2, mesh.pp_rank)
        opt = pt._optimizer([p for s in stages for p in s.parameters()])
        schedule, losses = build_schedule(kind, 2, 4, virtual=virtual), []
        for step in range(pt.STEPS):
            x, y = (t.to(dev) for t in synthetic_batch(pt.B, pt.T, pt.CFG["vocab_size"], seed=1, step=step))
            opt.zero_grad(set_to_none=True)
            result = run_pipeline(schedule, stages, x, y, group=mesh.pp_group, tied_group=tied)
            losses.append(None if result.loss is None else result.loss.item())
            opt.step()
        out[kind] = losses, _cpu((n, p) for s in stages for n, p in s.named_parameters())
    return out


@needs_two_gpus
def test_pipeline_with_a_tied_embedding_on_nccl():
    import test_pipeline_parity as pt

    want_losses, _, want_params = pt._reference(True, False)
    for rank, out in enumerate(_launch_nccl(_pp_nccl_body)):
        for kind, (losses, params) in out.items():
            if rank == 1:  # the last stage computes the loss
                pt.LOSS_TOL.assert_losses(losses, want_losses, f"{kind} losses")
            pt.WEIGHT_TOL.assert_weights(params, {n: want_params[n] for n in params}, f"rank {rank} {kind}")


def _ep_nccl_body():
    import test_expert_parallel_dist as e
    from reference.expert_parallel import ExpertParallelMoE, moe_all_reduce_gradients
    from reference.mesh import Mesh

    _fp32_matmuls()
    mesh, dev, out = Mesh(dp=2, ep=2).build_groups(), device(), {}
    rows = slice(mesh.dp_rank * e.B // 2, (mesh.dp_rank + 1) * e.B // 2)
    for case in e.CASES:
        layer = ExpertParallelMoE.from_dense(e.make_moe(case).to(dev), mesh.ep_group)
        opt, ys = torch.optim.AdamW(layer.parameters(), **e.ADAM), []
        for step in range(e.STEPS):
            x, target = (t[rows].to(dev) for t in e.batch(step))
            y, aux = layer(x)
            (F.mse_loss(y, target) + aux).backward()
            moe_all_reduce_gradients(layer, mesh.dp_group, mesh.edp_group)
            ys.append(y.detach().cpu())
            opt.step()
            opt.zero_grad()
        out[case] = ys, _cpu(e.global_names(layer).items()), rows
    return out


@needs_two_gpus
def test_expert_parallel_on_nccl():
    import test_expert_parallel_dist as e

    for rank, out in enumerate(_launch_nccl(_ep_nccl_body)):
        for case, (ys, params, rows) in out.items():
            steps, want = e.oracle(case)
            for step, y in enumerate(ys):
                _close(y, steps[step]["y"][rows], f"rank {rank} {case} output of step {step}", TOL)
            adamw_weights(e.STEPS, e.ADAM["lr"]).assert_weights(params, {n: want[n] for n in params},
                                                                f"rank {rank} {case}")


@needs_two_gpus
def test_global_clip_on_nccl():
    """test_clip's rank bodies (DDP, ZeRO-1/2, FSDP, TP with SP, PP with a tied embedding),
    the norm's all-reduce on the GPU."""
    import test_clip as c

    results = _launch_nccl(c._two_ranks)
    expected = c.oracle()
    c.check_ddp(results, expected)  # with test_clip's own tolerances
    for stage in (1, 2):
        c.check_zero(results, stage)
    c.check_fsdp(results, expected)
    c.check_tp(results, expected)
    c.check_pp(results, expected)


NOTEBOOKS = sorted(p for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("0[0-5]_*.ipynb"))


@needs_two_gpus
@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_headless_on_gpus(path, tmp_path):
    """Launches of up to `gpus` ranks pick NCCL (backend "auto"); larger ones stay on gloo."""
    import test_notebooks

    test_notebooks.test_notebook_runs_headless_within_budget(path, tmp_path)


def _sample_on_gpu():
    from reference.model import GPT, GPTConfig
    from reference.parallel import ParallelConfig, generate, parallelize

    _fp32_matmuls()
    torch.manual_seed(0)
    config = ParallelConfig.single()
    model = GPT(GPTConfig.tiny()).to(runtime.device())
    pm = parallelize(model, config.mesh().build_groups(), config)
    prompt = torch.tensor([[1, 2, 3]])
    on_gpu = generate(pm, prompt, 8, temperature=0.8, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    plain = GPT(GPTConfig.tiny())
    on_cpu = plain.generate(prompt, 8, 0.8, None, torch.Generator().manual_seed(3))
    return on_gpu.cpu(), on_cpu


@needs_gpu
def test_sampling_on_a_gpu_with_a_cpu_generator():
    """The trainer samples at the end of a run with a CPU generator: on CUDA logits that
    raised ("Expected a 'cuda' device type for generator"); now the tokens are drawn where
    the generator lives, the same as on the CPU."""
    got, want = launch(_sample_on_gpu, 1, backend="nccl", timeout=TIMEOUT, quiet=True)[0]
    assert torch.equal(got, want)
