import os

import torch

# Triton kernels run under the interpreter where there is no GPU. This must be set before Triton compiles anything,
# i.e. before peft_csgmv.kernels is imported by any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
