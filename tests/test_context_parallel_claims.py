"""The claims of notebook 08 that tests/test_context_parallel*.py do not already measure.

* plain attention saves 4 B H T^2 + T^2 bytes for backward (the fp32 probabilities and
  the boolean mask) and makes a (B H, T, T) tensor: x 4 per doubling of T;
* e^89 overflows float32 (the reason for the log-sum-exp form);
* the contiguous causal split gives the last rank about 2 cp - 1 times rank 0's pairs;
* both splits compute the same total; the ring's critical path (each step as long as its
  slowest rank) is cp n^2 score entries for the contiguous split and n^2 + (cp - 1) n^2 / 2
  for the zig-zag one: the zig-zag split is 2 cp / (cp + 1) times faster, towards 2;
* the ring sends cp / 2 times Ulysses' bytes per rank; the ring's tend to 2 B H T D b,
  Ulysses' fall as 1 / cp;
* the transfer of a block hides behind a causal zig-zag step's compute from
  T/cp = 2 b F / (2 W): 16,000 tokens at 400 Tflop/s (the notebook prints both) and 50 GB/s, 1,778 at 450 GB/s, so
  a 131,072-token sequence on cp = 8 (16,384 a rank) just breaks even across nodes (1.02)
  in the forward; the backward (3x the bytes for 2.5x the compute) hides only from 19,200 with
  dK, dV in float32, from 12,800 with them in bf16 (Transformer Engine: 2x the bytes);
* over a bf16 step the ring sends cp (float32 dK, dV) or 3 cp / 4 (bf16) times Ulysses' bytes;
  with GQA its forward sends less exactly when cp < 1 + H / H_kv;
* the contiguous split's last rank computes cp times rank 0's score entries (the diagonal
  block whole) for about 2 cp - 1 times its pairs;
* the pictures of `reference.context_parallel.viz`.

Bytes, memory and work measured on ranks against the formulas are in
test_context_parallel_bytes.py; parity with one process in test_context_parallel.py.
"""
import math

import pytest
import torch
from matplotlib.figure import Figure

from reference.context_parallel import (
    LargestTensor, SavedTensorBytes, block_plan, causal_pairs_per_rank, ring_attention_sent_bytes,
    ring_block_elements_per_rank, sequence_positions, ulysses_sent_bytes,
)
from reference.context_parallel import viz as cpviz


def _dense_attention(q, k, v):
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    later = torch.ones(T, T, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1) @ v


def test_plain_attention_memory_grows_as_t_squared():
    B, H, D = 1, 4, 8
    saved_bytes = []
    for T in (32, 64, 128):
        q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
        with SavedTensorBytes(exclude=(q, k, v)) as saved, LargestTensor() as largest:
            _dense_attention(q, k, v)
        assert saved.bytes == 4 * B * H * T * T + T * T
        assert largest.elements == B * H * T * T
        saved_bytes.append(saved.bytes)
    # (4 B H + 1) T^2: exactly 4 per doubling
    assert [b / a for a, b in zip(saved_bytes, saved_bytes[1:])] == [4.0, 4.0]


def test_exp_overflows_float32_from_89():
    assert math.isinf(torch.exp(torch.tensor(89.0)).item())
    assert math.isfinite(torch.exp(torch.tensor(88.0)).item())


def test_contiguous_split_last_rank_does_about_2cp_minus_1_times_rank_0():
    for cp in (2, 4, 8):
        work = causal_pairs_per_rank(4096 * cp, cp, zigzag=False)
        assert work[-1] / work[0] == pytest.approx(2 * cp - 1, rel=1e-3)
    # the notebook's picture: T = 16 on 4 ranks
    assert causal_pairs_per_rank(16, 4, zigzag=False) == [10, 26, 42, 58]
    assert causal_pairs_per_rank(16, 4, zigzag=True) == [34] * 4


def _critical_path(T, cp, zigzag):
    n = T // cp
    steps = [[(p.block_elements(n) if p is not None else 0)
              for p in (block_plan(i, (i - s) % cp, cp, n, True, zigzag) for s in range(cp))]
             for i in range(cp)]
    # the per-rank totals are what ring attention computes (measured with flops elsewhere)
    assert [sum(row) for row in steps] == ring_block_elements_per_rank(T, cp, zigzag=zigzag)
    return sum(max(steps[i][s] for i in range(cp)) for s in range(cp))


@pytest.mark.parametrize("cp", [2, 3, 4, 8, 16])
def test_zigzag_critical_path(cp):
    T = 8 * cp
    n = T // cp
    contiguous, zigzag = _critical_path(T, cp, False), _critical_path(T, cp, True)
    assert contiguous == cp * n * n
    assert 2 * zigzag == 2 * n * n + (cp - 1) * n * n
    assert contiguous / zigzag == pytest.approx(2 * cp / (cp + 1), rel=1e-12)
    # the same total work, cp (cp + 1) / 2 blocks of n^2, shared out differently
    for zz in (False, True):
        assert 2 * sum(ring_block_elements_per_rank(T, cp, zigzag=zz)) == cp * (cp + 1) * n * n
    if cp == 4:
        assert contiguous / zigzag == pytest.approx(1.6, rel=1e-12)  # the notebook's run


def test_ring_sends_cp_over_2_times_ulysses():
    B, H, T, D, b = 1, 32, 131_072, 128, 2
    for cp in (2, 4, 8, 16, 32):
        ring = ring_attention_sent_bytes(B, H, T, D, cp, element_size=b)["forward"]
        ulysses = ulysses_sent_bytes(B, H, T, D, cp, element_size=b)["forward"]
        assert ring / ulysses == pytest.approx(cp / 2, rel=1e-12)
    everything = 2 * B * H * T * D * b  # every key and value passes every rank
    ring_at = {cp: ring_attention_sent_bytes(B, H, T, D, cp, element_size=b)["forward"]
               for cp in (2, 64, 1024)}
    assert ring_at[2] < ring_at[64] < ring_at[1024] < everything
    assert ring_at[1024] / everything == pytest.approx(1023 / 1024, rel=1e-12)
    ulysses_at = {cp: ulysses_sent_bytes(B, H, T, D, cp, element_size=b)["forward"] for cp in (4, 8)}
    assert ulysses_at[8] / ulysses_at[4] == pytest.approx((7 / 64) / (3 / 16), rel=1e-12)


def _hidden_from(flops_per_s, bytes_per_s, bytes_per_element=2, B=1, H=1, D=128, cp=8, backward=False,
                 grad_bytes=4):
    """Smallest n = T/cp (even) whose causal zig-zag step computes at least as long as its
    message takes, counted from the block plans and the byte formula (the backward: five
    products of the block instead of two, K and V again with dK and dV at ``grad_bytes``)."""
    n = 2
    while True:
        plan = block_plan(1, 0, cp, n, True, True)              # a step after the first
        products = 5 if backward else 2                          # q k^T and P V; S, dV, dP, dQ, dK
        flops = 2 * products * B * H * D * plan.block_elements(n)
        sent = ring_attention_sent_bytes(B, H, n * cp, D, cp, element_size=bytes_per_element,
                                         grad_element_size=grad_bytes)
        per_step = sent["backward" if backward else "forward"] // (cp - 1)
        if flops * bytes_per_s >= per_step * flops_per_s:        # flops / F >= bytes / W, in integers
            return n
        n += 2


def test_ring_transfer_hides_behind_compute_from_the_notebooks_thresholds():
    across, inside = _hidden_from(400 * 10**12, 50 * 10**9), _hidden_from(400 * 10**12, 450 * 10**9)
    assert across == 16_000                        # the notebook's 16,000
    assert inside == 1_778                         # the notebook's ceil(1,777.8)
    assert 131_072 // 8 == 16_384 >= across
    assert 16_384 / across == pytest.approx(1.024)                 # "just breaks even"
    back = _hidden_from(400 * 10**12, 50 * 10**9, backward=True)   # 3x the bytes, 2.5x the compute
    assert back == 19_200 > 16_384                                 # the backward does not hide there
    # Transformer Engine's AttnFuncWithCPAndKVP2P sends [kv, dkv] in kv's dtype: 2x the bytes
    assert _hidden_from(400 * 10**12, 50 * 10**9, backward=True, grad_bytes=2) == 12_800 < 16_384
    from reference.comms.links import NIC, NVLINK
    assert (NIC.bandwidth, NVLINK.bandwidth) == (50e9, 450e9)      # the course's links


def test_flops_against_pairs_of_the_contiguous_split():
    T, cp = 64, 4
    pairs = causal_pairs_per_rank(T, cp, zigzag=False)
    entries = ring_block_elements_per_rank(T, cp, zigzag=False)
    assert entries[-1] / entries[0] == cp and 2 * cp - 2 < pairs[-1] / pairs[0] < 2 * cp - 1


# ------------------------------------------------------------------ the pictures

def test_pictures():
    msgs = [{"step": s, "src": r, "dst": (r + 1) % 3, "bytes": 96, "block": (r - s) % 3}
            for s in range(2) for r in range(3)]
    fig = cpviz.plot_ring_messages(msgs, 3)
    ax = fig.axes[0]
    assert isinstance(fig, Figure) and len(ax.patches) == 3 * 3 and len(ax.texts) == 9 + len(msgs)
    # the block each rank holds at step 2 is what it received at step 1
    labels = {t.get_text() for t in ax.texts}
    assert {"K,V of 0", "K,V of 1", "K,V of 2"} <= labels and "96 bytes" in ax.get_title()

    owners = {name: [0] * 8 for name in ("contiguous", "zig-zag")}
    for r in range(2):
        for name, zz in (("contiguous", False), ("zig-zag", True)):
            for p in sequence_positions(8, 2, r, zz).tolist():
                owners[name][p] = r
    fig = cpviz.plot_causal_split(owners)
    titles = [a.get_title() for a in fig.axes]
    assert "[10, 26]" in titles[0] and "[18, 18]" in titles[1]

    fig = cpviz.plot_work_per_rank({"a": [[4, 0], [4, 4]], "b": [[4, 2], [4, 2]]})
    assert "max / min = 2.00" in fig.axes[0].get_title() and "1.00" in fig.axes[1].get_title()

    fig = cpviz.plot_bytes_per_rank([1, 2, 4, 8], [0, 8, 12, 14], [0, 8, 6, None], {"ring": {2: 8}})
    assert fig.axes[0].get_legend() is not None
    fig = cpviz.plot_memory_vs_length([8, 16], {"m": [1, 4]}, {"f": [1, 4]})
    assert len(fig.axes[0].lines) == 2


def test_a_step_s_bytes_with_dk_dv_in_either_dtype_and_the_gqa_condition():
    """Over a bf16 step with every head the ring sends cp times Ulysses' bytes when dK and dV
    travel in float32 (the course's ring_attention, ring-flash-attention) and 3 cp / 4 times
    when they travel in bf16 (Transformer Engine's [kv, dkv] buffer): 6 at cp = 8. With GQA the
    ring's forward sends less exactly when cp < 1 + H / H_kv (not at cp = 4 with 8 and 4 heads:
    6,144 against 4,608 bytes on the notebook's small layer; Llama-3-70B's 64 and 8 at cp = 8)."""
    B, H, T, D = 1, 32, 131_072, 128
    for cp in (2, 4, 8, 16):
        uly = sum(ulysses_sent_bytes(B, H, T, D, cp, 2).values())
        fp32 = sum(ring_attention_sent_bytes(B, H, T, D, cp, 2).values())
        bf16 = sum(ring_attention_sent_bytes(B, H, T, D, cp, 2, grad_element_size=2).values())
        assert fp32 == cp * uly and 4 * bf16 == 3 * cp * uly
    for H, kv in ((8, 4), (64, 8), (32, 8), (16, 16)):
        for cp in range(2, 33):
            ring = ring_attention_sent_bytes(1, H, 64 * cp, 8, cp, 2, kv_heads=kv)["forward"]
            uly = ulysses_sent_bytes(1, H, 64 * cp, 8, cp, 2, kv_heads=kv)["forward"]
            assert (ring < uly) == (cp < 1 + H / kv), (H, kv, cp)
    small = (ring_attention_sent_bytes(1, 8, 64, 8, 4, 2, kv_heads=4)["forward"],
             ulysses_sent_bytes(1, 8, 64, 8, 4, 2, kv_heads=4)["forward"])
    assert small == (6_144, 4_608)


def test_sequence_parallelism_fits_t_times_the_tokens_with_a_fused_kernel():
    """Korthikanti et al.: with SP a layer stores sbh(34/t + 5as/(ht)) bytes, every term divided
    by t, so in the memory one GPU gives a layer of s tokens, t GPUs hold t s with a fused kernel
    (no s x s scores), between sqrt(t) s and t s with the scores stored; what the notebook says
    in its introduction and SP section (not that SP "does not lengthen the context"), with a
    self-check that has its answers."""
    import json
    from pathlib import Path
    from reference.parallel.estimate_memory import activation_bytes_per_block

    h, a, t, s = 12_288, 96, 8, 2_048
    for attention in ("fused", "unfused"):
        one = activation_bytes_per_block(s, 1, h, a, attention=attention)
        sp = activation_bytes_per_block(s, 1, h, a, t, True, attention=attention)
        assert one == t * sp                                      # every term divided by t
        assert activation_bytes_per_block(t * s, 1, h, a, t, True, attention=attention) == (
            one if attention == "fused" else pytest.approx(one * (34 + 5 * a * t * s / h) / (34 + 5 * a * s / h)))
    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "08_context_parallel.ipynb").read_text())
    text = " ".join(" ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown").split())
    assert "does not lengthen the context" not in text and "$t$ times the tokens fit" in text
    assert "$\\mathrm{cp} < 1 + H/H_{kv}$" in text and "Transformer Engine" in text
    # _ExpandKVFunction: VILA's, copied into NVlabs' Long-RL (its verl fork) and on from there;
    # upstream verl is not among them
    assert "from which verl's" not in text and "Long-RL, a fork of verl" in text
    ids = [c["id"] for c in nb["cells"]]
    assert ids.index("selfcheck-answers") == ids.index("59e155b0") + 1
    # question 3: forward 2 (cp - 1) blocks, backward 4 (cp - 1), 6 (cp - 1) over both (not 4 (cp - 1))
    answers = "".join(nb["cells"][ids.index("selfcheck-answers")]["source"])
    assert "fwd8 + bwd8" in answers and "forward and backward {4 * (8 - 1)}" not in answers
    blocks = ring_attention_sent_bytes(1, 1, 64, 8, 8, 2, grad_element_size=2)
    assert (blocks["forward"], blocks["backward"]) == (14 * 128, 28 * 128)   # (1, 1, 8, 8) bf16 blocks
