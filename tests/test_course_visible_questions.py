"""Every numeric question's visible check asserts the worked values its text publishes: the
solution passes, and an answer of the right type that is off on the worked example fails."""
import pytest

from reference.course import checks
from tests.solution_cells import solution_function

# (homework, the question's function, its visible check, kind)
QUESTIONS = [
    ("00_collectives", "ring_doubling_crossover", "check_ring_doubling_crossover", "real"),
    ("01_data_parallel", "ddp_bytes_per_step", "check_ddp_bytes_per_step", "int"),
    ("02_zero_fsdp", "zero_max_params", "check_zero_max_params", "int"),
    ("03_tensor_parallel", "tp_layer_bytes", "check_tp_layer_bytes", "int"),
    ("04_pipeline_parallel", "interleaved_peak_bytes", "check_interleaved_peak_bytes", "int"),
    ("05_expert_parallel", "dedup_all_to_all_bytes", "check_dedup_all_to_all_bytes", "int"),
    ("06_3d_parallel", "step_bytes_3d", "check_step_bytes_3d", "int"),
    ("07_performance", "mfu", "check_mfu", "real"),
    ("08_context_parallel", "ring_forward_bytes", "check_ring_forward_bytes", "int"),
]


@pytest.mark.parametrize("stem, exercise, check, kind", QUESTIONS, ids=[q[0] for q in QUESTIONS])
def test_visible_check_asserts_the_worked_values(stem, exercise, check, kind, capsys):
    right = solution_function(stem, exercise)
    check_fn = getattr(checks, check)
    assert check_fn(right) is True, capsys.readouterr().out
    assert "worked value" in capsys.readouterr().out

    if kind == "int":
        def off(**kw):  # the right type, one byte off everywhere
            return right(**kw) + 1
    else:
        def off(**kw):  # a finite float, 0.1 % off everywhere
            return right(**kw) * 1.001
    assert check_fn(off) is False
    out = capsys.readouterr().out
    assert f"FAIL {exercise}" in out and "the text's worked example" in out


def test_a_wrong_number_on_the_concrete_case_alone_still_passes(capsys):
    """The concrete case is the student's to answer: its value is never published, only its kind."""
    right = solution_function("08_context_parallel", "ring_forward_bytes")

    def only_big_cases_wrong(**kw):
        return right(**kw) + (1 if kw["T"] > 64 else 0)
    assert checks.check_ring_forward_bytes(only_big_cases_wrong) is True
    assert checks.check_ring_forward_bytes(lambda **kw: float(right(**kw))) is False
    assert "whole number" in capsys.readouterr().out
