"""reference.memory: the ZeRO paper's formulas, and the bytes a live model really holds.

The distributed checks (measured bytes of ZeRO-1/2/3 on 2 and 4 ranks equal the
formulas, and the peak of ZeRO-2's gradients inside a step) are in test_zero.py and
test_zero_peak.py; here the formulas themselves and the measurements on one process.
"""
import pytest
import torch

from reference import memory
from reference.memory import MemoryBytes, Precision, human_bytes, measure, model_state_bytes
from reference.model import GPT, GPTConfig


def test_paper_figure_1():
    # ZeRO paper, figure 1: Psi = 7.5B parameters, mixed-precision Adam (K = 12),
    # N = 64 ranks: 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per rank.
    psi, n = 7_500_000_000, 64
    got = [model_state_bytes(psi, n, stage, Precision.mixed_adam()).model_states for stage in range(4)]
    assert got == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    assert [round(b / 1e9, 1) for b in got] == [120.0, 31.4, 16.6, 1.9]


def test_each_stage_shards_one_more_state():
    psi, n = 1200, 4  # divisible: no padding
    p = Precision.fp32_adam()
    rows = [model_state_bytes(psi, n, s, p) for s in range(4)]
    assert rows[0] == MemoryBytes(4 * psi, 4 * psi, 8 * psi)
    assert rows[1] == MemoryBytes(4 * psi, 4 * psi, 8 * psi // n)
    assert rows[2] == MemoryBytes(4 * psi, 4 * psi // n, 8 * psi // n)
    assert rows[3] == MemoryBytes(4 * psi // n, 4 * psi // n, 8 * psi // n)
    # with one rank every stage holds what plain data parallelism holds
    assert {model_state_bytes(psi, 1, s, p) for s in range(4)} == {rows[0]}


def test_padding_per_flat_buffer():
    # Two units of 10 and 7 numbers on 4 ranks: shards of 3 and 2 (padding 2 and 1).
    units = [10, 7]
    fsdp = model_state_bytes(17, 4, 3, units=units)
    assert fsdp == MemoryBytes(4 * 5, 4 * 5, 8 * 5)
    # One buffer of 17: shard 5 as well, and stage 1 holds the padded 20 whole.
    assert model_state_bytes(17, 4, 1) == MemoryBytes(4 * 20, 4 * 20, 8 * 5)
    assert model_state_bytes(17, 4, 2) == MemoryBytes(4 * 20, 4 * 5, 8 * 5)
    # Plain data parallelism flattens nothing: no padding.
    assert model_state_bytes(17, 4, 0) == MemoryBytes(68, 68, 136)


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="stage must be 0"):
        model_state_bytes(10, 2, 4)
    with pytest.raises(ValueError, match="dp must be a positive int"):
        model_state_bytes(10, 0, 1)
    with pytest.raises(ValueError, match="add up to 9, not num_params=10"):
        model_state_bytes(10, 2, 3, units=[4, 5])


def _trained(optimizer_class, **kwargs):
    model = GPT.from_config_seed(GPTConfig.tiny(), 0)
    opt = optimizer_class(model.parameters(), **kwargs)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    return model, opt


def test_one_process_holds_the_data_parallel_formula():
    # What every rank of plain data parallelism holds: the whole model with Adam.
    model, opt = _trained(torch.optim.AdamW, lr=1e-3)
    psi = model.num_parameters()  # the tied wte / lm_head counted once
    n_tensors = len(list(model.parameters()))
    got = measure(model, opt)
    assert got.model_states == model_state_bytes(psi, 1, 0).model_states == 16 * psi
    assert (got.params, got.grads, got.optimizer_state) == (4 * psi, 4 * psi, 8 * psi)
    assert got.other == 4 * n_tensors  # Adam's step counters, outside the formula


def test_sgd_momentum_has_one_state_per_parameter():
    model, opt = _trained(torch.optim.SGD, lr=0.1, momentum=0.9)
    psi = model.num_parameters()
    want = model_state_bytes(psi, 1, 0, Precision.fp32_sgd_momentum())
    got = measure(model, opt)
    assert (got.params, got.grads, got.optimizer_state, got.other) == \
        (want.params, want.grads, want.optimizer_state, 0)


def test_views_of_one_buffer_count_once_and_freed_storage_counts_zero():
    flat = torch.zeros(12)
    params = [torch.nn.Parameter(flat[:5]), torch.nn.Parameter(flat[5:])]
    grads = torch.ones(12)
    params[0].grad, params[1].grad = grads[:5], grads[5:]
    assert measure(params) == MemoryBytes(48, 48, 0)
    freed = torch.nn.Parameter(torch.zeros(100))
    freed.untyped_storage().resize_(0)  # what FSDP does to a block's full parameters
    assert measure([freed]) == MemoryBytes(0, 0, 0)


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * 2 ** 30) == "3.00 GiB"


def test_peak_formula_and_bad_input():
    assert memory.zero_peak_grad_bytes(10, 4, 1) == 4 * (12 + 3)     # P = 12, S = 3
    assert memory.zero_peak_grad_bytes(10, 4, 2) == 4 * (3 + 12)     # one bucket of P
    assert memory.zero_peak_grad_bytes(10, 4, 2, bucket_numel=5, grad_bytes=2) == 2 * (3 + 5)
    with pytest.raises(ValueError, match="stages 1 and 2, got stage=3"):
        memory.zero_peak_grad_bytes(10, 4, 3)
    with pytest.raises(ValueError, match="bucket_numel must be in 1..P=12"):
        memory.zero_peak_grad_bytes(10, 4, 2, bucket_numel=13)


def test_peak_memory_counts_new_storages_until_freed():
    a = torch.ones(100)                      # made before: never counted
    with memory.PeakMemory() as peak:
        b = a * 2                            # 400 B
        view = b[10:]                        # a view: no new storage
        a.add_(1)                            # in place: nothing new
        c = torch.empty(50)                  # 200 B
        del b                                # the view keeps b's storage alive
        assert peak.live_bytes == 600
        del view, c
        assert peak.live_bytes == 0
        d = torch.zeros(25)                  # 100 B, after the frees
    assert (peak.peak_bytes, peak.live_bytes) == (600, 100)
    del d
