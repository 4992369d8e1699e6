"""fp32 linear layers on oneDNN with weights packed once, where that beats torch's BLAS here.

Torch's fp32 ``Linear`` on CPU calls the BLAS its wheel was built with (MKL on
PyPI). MKL runs its AVX2 kernels on CPUs it does not take for Intel's, so on an
AVX-512 AMD host a MiniLM forward ran at half the speed that oneDNN (in the same
wheel) reaches with the same weights packed for its kernels: one 384x1536 layer
at 2,048 rows, one thread, 108 against 254 GFLOPS. Which library wins depends
on the CPU, so ``linear: auto`` times both on the model's own widest layer when
it loads and keeps the faster, and only when the two agree to float rounding.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_MARGIN = 0.9  # oneDNN must take at most this share of BLAS's time to be worth a second copy
_ROWS = 512  # tokens in the timed product: a batch's worth of a small call mix
_AGREE = 1e-4  # largest difference allowed, relative to the output's scale


class OneDnnLinear(torch.nn.Module):
    """A ``Linear`` whose weight is packed for oneDNN once; inference only.

    ``gelu=True`` applies the exact (erf) gelu inside the product, as it writes
    each output block: the same floats as ``F.gelu`` after it, without a second
    pass over an output too wide for the core's cache.
    """

    def __init__(self, linear: torch.nn.Linear, *, gelu: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.post, self.algorithm = ("gelu", "none") if gelu else ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.post, [], self.algorithm)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on the CPU with oneDNN in this torch build (other dtypes and devices have their own paths)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def widest(module: torch.nn.Module) -> torch.nn.Linear | None:
    """The linear layer with the most weights: the one the forward spends most on."""
    layers = [m for m in module.modules() if type(m) is torch.nn.Linear]
    return max(layers, key=lambda m: m.weight.numel(), default=None)


def time_ratio(a: Callable[[], Any], b: Callable[[], Any], pairs: int = 9,
               clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over interleaved pairs of ``a``'s time over ``b``'s.

    A model often loads while other processes load theirs (several gateways, or
    replicas, starting at once). Timing one side's runs and then the other's let a
    burst of that load land on one side only and flip the choice from start to
    start; a pair's two runs share the moment, and the median drops the bursts.
    """
    a(), b()  # first calls: allocation, kernel choice
    ratios = []
    for i in range(pairs):
        first, second = (a, b) if i % 2 == 0 else (b, a)  # neither side always runs on a warm cache
        t0 = clock()
        first()
        t1 = clock()
        second()
        t2 = clock()
        ta, tb = (t1 - t0, t2 - t1) if first is a else (t2 - t1, t1 - t0)
        ratios.append(ta / tb)
    return statistics.median(ratios)


def faster(linear: torch.nn.Linear) -> tuple[bool, float]:
    """Whether oneDNN beats BLAS on ``linear`` here (and agrees with it), and the time ratio."""
    candidate = OneDnnLinear(linear)
    x = torch.randn(_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference, packed = linear(x), candidate(x)
        scale = float(reference.abs().max()) or 1.0
        if float((reference - packed).abs().max()) > _AGREE * scale:
            log.warning("oneDNN's linear disagrees with torch's here; keeping torch's")
            return False, 1.0
        ratio = time_ratio(lambda: candidate(x), lambda: linear(x))
    return ratio <= _MARGIN, ratio


def swap_linears(module: torch.nn.Module) -> None:
    """Replace every ``Linear`` under ``module`` by its oneDNN form, in place.

    Only for modules the caller owns: a replaced child is gone from ``module``
    but not from any other module holding it.
    """
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            setattr(module, name, OneDnnLinear(child))
        else:
            swap_linears(child)


def onednn_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its linear layers on oneDNN; every other weight is shared, not copied."""
    keep: dict[int, Any] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    twin = copy.deepcopy(model, memo=keep)
    swap_linears(twin)
    return twin
