"""Settings every test shares."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    """The tests' tensors are tiny and the cores are shared with the ranks the tests
    start: more intra-op threads in this process would only spin against them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The files that take minutes, longest first (measured with `--durations`). `make test`
# hands work to its workers in the order collected (`--no-loadscope-reorder`: without it
# pytest-xdist 3.5 and later order the files by their number of tests, which sent the
# checkpoint matrix and the sweep, a few tests each, to the end): starting with the longest
# and leaving the many short files for the end lets the workers finish at about the same
# time, instead of one worker starting a long file when the others have nothing left.
LONGEST_FIRST = ("test_notebooks.py", "test_parallel_sweep.py", "test_checkpoint_reshard_matrix.py",
                 "test_course_grade.py", "test_course_exercises.py", "test_course_homework.py",
                 "test_train_cli.py",
                 "test_browser.py", "test_pipeline_parity.py", "test_train_checkpoint.py",
                 "test_fsdp_composed.py", "test_nb06_composition.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
