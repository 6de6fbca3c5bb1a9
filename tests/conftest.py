import os

import torch

# Triton kernels run under the interpreter where there is no GPU. This must be set before Triton compiles anything,
# i.e. before peft_csgmv.kernels is imported by any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The ops' compile-ahead thread (on by default on CUDA) runs each traced op once more over scratch tensors, which tests
# that count kernel launches or op calls would count: off unless a test turns it on (tests/test_compile_ahead.py's
# compile-ahead tests do; PEFT_CSGMV_COMPILE_AHEAD=1 turns it on for the whole suite).
os.environ.setdefault("PEFT_CSGMV_COMPILE_AHEAD", "0")

import importlib  # noqa: E402
import types  # noqa: E402

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
def fresh_dynamo():
    """dynamo's caches and counters empty before and after the test (compiled-path tests count graphs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def static_caches(monkeypatch):
    """The transformers ``StaticCache`` objects made during the test (``generate`` makes them through the class in
    ``transformers.cache_utils``), in order."""
    import transformers.cache_utils as cache_utils

    made, init = [], cache_utils.StaticCache.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.StaticCache, "__init__", counting)
    return made


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


class Recorder:
    """Stands in for a ``@triton.jit`` kernel and the compiled kernels it returns: records each launch as
    ``(kernel, "triton" | "direct", grid, args, options)``."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def first_launch(*args, **kwargs):
            self.log.append((self.name, "triton", grid, args, tuple(kwargs.items())))
            return types.SimpleNamespace(run=self.run, function=f"{self.name}-fn", packed_metadata=f"{self.name}-meta")

        return first_launch

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert (function, metadata, stream) == (f"{self.name}-fn", f"{self.name}-meta", "stream")
        self.log.append((self.name, "direct", (gx, gy, gz), args, ()))


@pytest.fixture
def recorded(monkeypatch):
    """Every shrink / expand launch recorded instead of run, as on a GPU (the direct launch path on, the layers on the
    Triton backend): the launch log."""
    import peft_csgmv.layers as csgmv_layers
    from peft_csgmv.kernels import launch

    log: list = []
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(
        launch, "_driver", types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda d: "stream"))
    )
    monkeypatch.setattr(csgmv_layers, "use_triton", lambda backend, device: True)
    bound_mod = importlib.import_module("peft_csgmv.kernels.bound")
    for name in ("shrink", "expand"):
        mod = importlib.import_module(f"peft_csgmv.kernels.{name}")
        attr = f"_launch_{name}"
        launcher = launch.Launcher(Recorder(name, log), getattr(mod, attr).num_tensors)
        launcher.direct = True
        monkeypatch.setattr(mod, attr, launcher)
        monkeypatch.setattr(bound_mod, attr, launcher)
    return log
