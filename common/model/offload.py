"""The offloaded target: decoder layers live in (pinned) host memory and stream to the accelerator.

This is what makes SpecExec pay: a model larger than GPU memory costs one sweep of its weights over
PCIe per forward pass, whether the pass carries 1 token or 1000, so the target should verify large
trees. Each streamed layer's parameters are one flat host buffer; a ring of device buffers, each bound
to a template `DecoderLayer`, receives them. While layer j computes on the default stream, layers
j+1 .. j+ring-1 are already copying on a side stream; events order each buffer's reuse. Embeddings,
the final norm, the LM head, the KV cache and the first `resident_layers` layers stay on the device.

The weights are never held twice: each layer's parameters move into its flat buffer and the original
module is dropped. The flat buffers are slices of one ordinary host allocation that is page-locked in
place with `cudaHostRegister` once filled: `pin_memory=True` would go through PyTorch's caching host
allocator, which rounds every block up to a power of two (a 525 MiB Qwen2.5-14B layer takes 1 GiB of
locked RAM). On a CPU "device" the same code runs with plain synchronous copies, which is how the
ring and the weight binding are tested on machines without a GPU.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from common.model.choices import OffloadPlan
from common.model.loading import LoadedModel, load_model
from common.model.transformer import DecoderLayer, Transformer


def _fill(flat: Tensor, layer: nn.Module) -> None:
    """Copy `layer`'s parameters into the 1-D `flat`, in `parameters()` order (the order `_bind` uses)."""
    offset = 0
    for p in layer.parameters():
        n = p.numel()
        flat[offset : offset + n].copy_(p.detach().reshape(-1))
        offset += n


def _pin(store: Tensor) -> None:
    """Page-lock `store` where it lies, so copies from it are true asynchronous DMA."""
    nbytes = store.numel() * store.element_size()
    portable = 1  # cudaHostRegisterPortable: locked for every CUDA context
    err = int(torch.cuda.cudart().cudaHostRegister(store.data_ptr(), nbytes, portable))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of layer weights failed with cudaError {err}")


def _unpin(store: Tensor, copy_stream: Any) -> None:
    copy_stream.synchronize()  # no prefetch may still be reading the pages
    torch.cuda.cudart().cudaHostUnregister(store.data_ptr())


def _bind(layer: nn.Module, flat: Tensor) -> None:
    """Make `layer`'s parameters views into `flat`, in `parameters()` order (the order `_fill` used)."""
    offset = 0
    for module in layer.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            n = param.numel()
            view = flat[offset : offset + n].view(param.shape)
            setattr(module, name, nn.Parameter(view, requires_grad=False))
            offset += n


class StreamedLayers(nn.Module):
    """Iterating yields each decoder layer in order, with its weights on the device by the time the
    caller's computation on it is enqueued. Stands in for `Backbone.layers`; takes ownership of (and
    empties) the `layers` list it is given."""

    def __init__(
        self, layers: list[DecoderLayer], device: torch.device, resident_layers: int, ring: int
    ) -> None:
        super().__init__()
        if device.type == "cuda" and device.index is None:  # streams and events belong to one device
            device = torch.device("cuda", torch.cuda.current_device())
        if ring < 1:
            raise ValueError(f"prefetch ring must hold at least 1 layer, got {ring}")
        if not 0 <= resident_layers <= len(layers):
            raise ValueError(f"resident_layers must be in [0, {len(layers)}], got {resident_layers}")
        self.device = device
        self.on_cuda = device.type == "cuda"  # not `self.cuda`: that would shadow `nn.Module.cuda()`
        self.resident = nn.ModuleList(layers.pop(0).to(device) for _ in range(resident_layers))
        self.ring = min(ring, len(layers))
        self.host: list[Tensor] = []
        store: Tensor | None = None  # every streamed layer's weights, one allocation
        template = copy.deepcopy(layers[0]).to("meta") if layers else None
        if template is not None and next(template.buffers(), None) is not None:
            raise ValueError("streamed decoder layers must hold parameters only, not buffers")
        if layers:
            per_layer = sum(p.numel() for p in layers[0].parameters())
            dtype = next(layers[0].parameters()).dtype
            # Pages are committed as they are written, so host memory grows by what each freed layer gives back.
            store = torch.empty(per_layer * len(layers), dtype=dtype)
            self.host = list(store.split(per_layer))
        for flat in self.host:  # popping frees each original layer as soon as its weights are copied
            _fill(flat, layers.pop(0))
        self.copy_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.slots: list[Tensor] = []
        self.templates: list[nn.Module] = []
        for _ in range(self.ring):
            flat = torch.empty_like(self.host[0], device=device)
            if self.copy_stream is not None:  # written on the copy stream: no reuse before those copies end
                flat.record_stream(self.copy_stream)
            layer = copy.deepcopy(template)  # on "meta": binding gives it its only storage
            _bind(layer, flat)
            self.slots.append(flat)
            self.templates.append(layer)
        self.copied = [self._event() for _ in range(self.ring)]
        self.freed = [self._event() for _ in range(self.ring)]
        self.loaded = [-1] * self.ring  # which streamed layer each slot holds (or is receiving)
        if self.on_cuda and store is not None:
            _pin(store)
            weakref.finalize(self, _unpin, store, self.copy_stream).atexit = False

    def _event(self):
        return torch.cuda.Event() if self.on_cuda else None

    def __len__(self) -> int:
        return len(self.resident) + len(self.host)

    @property
    def streamed_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)

    def _fetch(self, j: int) -> None:
        s = j % self.ring
        if self.loaded[s] == j:
            return
        self.loaded[s] = j
        if not self.on_cuda:
            self.slots[s].copy_(self.host[j])
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[s])
            self.slots[s].copy_(self.host[j], non_blocking=True)
            self.copied[s].record(self.copy_stream)

    def __iter__(self) -> Iterator[nn.Module]:
        yield from self.resident
        n = len(self.host)
        for j in range(min(self.ring, n)):
            self._fetch(j)
        for j in range(n):
            s = j % self.ring
            if self.on_cuda:
                torch.cuda.current_stream(self.device).wait_event(self.copied[s])
            try:
                yield self.templates[s]
            finally:  # also when the pass stops early: kernels of layer j may be queued on the slot
                # The caller has enqueued layer j: its slot may be refilled once that work is done.
                if self.on_cuda:
                    self.freed[s].record(torch.cuda.current_stream(self.device))
            if j + self.ring < n:
                self._fetch(j + self.ring)
        for j in range(self.ring):  # the next pass's first layers, while the caller finishes this one
            self._fetch(j)


def offload(
    model: Transformer, device: str | torch.device, *, resident_layers: int = 0, ring: int = 2
) -> Transformer:
    """Move `model` (loaded on the CPU) onto `device` with its decoder layers streamed from host RAM."""
    device = torch.device(device)
    if model.device.type != "cpu":
        raise ValueError(f"offload expects a model loaded on the CPU, got one on {model.device}")
    if model.repacked:
        raise ValueError("offload needs row-major weights: load the model with repack=False")
    layers = list(model.model.layers)
    model.model.layers = nn.ModuleList()  # the streamer takes ownership of the weights
    streamed = StreamedLayers(layers, device, resident_layers, ring)
    model.to(device)
    model.model.layers = streamed
    return model


def load_target(
    path: str | Path, *, dtype: str, device: str, repack: bool = True, plan: OffloadPlan | None = None
) -> LoadedModel:
    """Load the target resident on `device`, or on the host and streamed to `device` under `plan`."""
    if plan is None:
        return load_model(path, dtype=dtype, device=device, repack=repack)
    loaded = load_model(path, dtype=dtype, device="cpu", repack=False)
    offload(loaded.model, device, resident_layers=plan.resident_layers, ring=plan.prefetch_layers)
    return loaded
