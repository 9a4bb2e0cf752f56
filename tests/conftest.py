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
