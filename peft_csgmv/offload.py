"""Layers that accelerate offloads: ``cpu_offload``, ``disk_offload``, a ``device_map`` with ``"cpu"`` / ``"disk"``
entries (``device_map="auto"`` with a ``max_memory`` smaller than the model), and PEFT's own re-dispatch of such a
model when it loads its first adapter.

accelerate keeps an offloaded module's weights in a weights map (host memory, or files on disk), leaves its
parameters on the ``meta`` device outside forward, and its ``AlignDevicesHook`` (``offload=True``) brings the module's
own weights to the hook's execution device for each forward and drops them after. csgmv never calls PEFT's
``lora_A`` / ``lora_B`` modules in a kernel layer, so their hooks never run there: a kernel layer whose base layer or
adapters are offloaded (an *offloaded layer*) reads its adapters from the hooks' weights maps when it stacks them
(:func:`adapter_weights`), and PEFT's parameters stay accelerate's (``meta``, replaced by the hooks at each of PEFT's
own forwards). Its stack lives in host memory (pinned where the execution device is a GPU) and comes to the execution
device with its layer, for each forward with ids (:meth:`~peft_csgmv.slots.LoraStack.lend`): the weights of the
call's adapters only, copied in stream order, dropped once the layer's kernels are queued. Nothing of it stays on the
GPU between forwards, as accelerate keeps nothing of the layer there. Where the execution device is the host itself
(the CPU), the stack is used where it is.
"""

from __future__ import annotations

import torch
from torch import nn


def offload_hook(module: nn.Module):
    """The accelerate ``AlignDevicesHook`` with ``offload=True`` and a weights map on ``module`` (on its own or in a
    ``SequentialHook``), or ``None``."""
    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return None
    for held in getattr(hook, "hooks", (hook,)):
        if getattr(held, "offload", False) and getattr(held, "weights_map", None) is not None:
            return held
    return None


def _device(device) -> torch.device:
    """A hook's ``execution_device`` (an int is a CUDA index, as accelerate takes it) as a ``torch.device``."""
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _adapter_holders(layer: nn.Module) -> list[nn.Module]:
    held = layer._modules
    holders = list(held["lora_A"]._modules.values()) if held.get("lora_A") is not None else []
    embedding = held.get("lora_embedding_A")
    if embedding is not None:
        holders.append(embedding)
    return holders


def execution_device(layer: nn.Module) -> torch.device | None:
    """Where accelerate runs a PEFT LoRA layer whose weights it offloads (the execution device of the offloading hook
    on its base layer, else on one of its adapters' modules); ``None`` where nothing of the layer is offloaded."""
    for module in (layer.get_base_layer(), *_adapter_holders(layer)):
        hook = offload_hook(module)
        if hook is not None and hook.execution_device is not None:
            return _device(hook.execution_device)
    return None


def offloaded_param(module: nn.Module, name: str) -> torch.Tensor | None:
    """Parameter ``name`` of ``module`` as it is, or, where accelerate offloads it (on ``meta`` outside forward), its
    value in the offloading hook's weights map (``None`` where neither holds it)."""
    param = module._parameters.get(name) if name in module._parameters else getattr(module, name, None)
    if param is None or param.device.type != "meta":
        return param
    hook = offload_hook(module)
    if hook is None:
        return param  # (on meta without a map: nothing to read; PEFT's path meets it)
    try:
        value = hook.weights_map[name]
    except KeyError:
        return param
    # (a map that loads onto the execution device: to the host now, where the stack copies from it; host code such as
    # a repack of the stack must not read a copy still in flight)
    return value if value.device.type in ("cpu", "meta") else value.to("cpu")


def adapter_weights(layer: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Adapter ``name``'s ``(A, B)`` weights in an offloaded LoRA Linear or Embedding layer, read from accelerate's
    weights maps where offloaded (:func:`~peft_csgmv.slots.layer_adapter`'s answer otherwise); ``None`` where the
    layer does not hold it."""
    held = layer._modules
    embedding = held.get("lora_embedding_A")
    if embedding is not None and name in embedding:
        return offloaded_param(embedding, name), offloaded_param(held["lora_embedding_B"], name)
    a = held["lora_A"]._modules.get(name)
    if a is None:
        return None
    return offloaded_param(a, "weight"), offloaded_param(held["lora_B"]._modules[name], "weight")


def on_meta(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` has no data (``meta``): offloaded, with no weights map to read it from."""
    return any(t is not None and t.device.type == "meta" for t in tensors)
