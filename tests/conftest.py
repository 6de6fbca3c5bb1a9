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


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's waiting threads slow
    them down several times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the patched layers' LoRA kernels (both backends go through ``layers.apply_lora``)."""
    calls = []
    import peft_csgmv.layers as csgmv_layers

    original = csgmv_layers.apply_lora

    def counting(*args, **kwargs):
        calls.append(args[-1])  # the triton flag
        return original(*args, **kwargs)

    monkeypatch.setattr(csgmv_layers, "apply_lora", counting)
    return calls
