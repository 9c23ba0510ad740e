import os

import pytest
import torch

# Two cores: keep each test process to one intra-op thread so parallel helpers / xdist do not thrash.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from dflash_export.models import load_drafter, load_target

    return load_target("tiny:qwen3/target"), load_drafter("tiny:qwen3/drafter")


@pytest.fixture(scope="session")
def tiny_llama():
    from dflash_export.models import load_drafter, load_target

    return load_target("tiny:llama/target"), load_drafter("tiny:llama/drafter")
