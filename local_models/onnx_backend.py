"""``backend: onnx``: the loaded model exported to ONNX at load time and run by ONNX Runtime.

The export takes the very weights the torch backend loaded (nothing is
fetched), through torch's TorchScript exporter, from a copy set to eager
attention: the graph of torch's fused attention (sdpa) carries a NaN guard
(IsNaN, Where) and ran the same int8 recipe at 1.36x sentence-transformers'
encode, against 1.63x from the eager graph (one thread, same run). The result
stands in for the transformers model: called with padded ``input_ids`` and
``attention_mask`` it returns the model's first output (hidden states or
logits), so pooling, normalisation and classification heads stay the same code
as for torch.

``quantize: int8``: dynamic int8 quantisation, recipe in ``onnx_int8``.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

log = logging.getLogger(__name__)
_sessions: dict[tuple[int, str | None, int, str], tuple[object, Any]] = {}  # the owner pins its id
_lock = threading.Lock()


class OnnxUnavailable(RuntimeError):
    pass


@dataclass(slots=True)
class _Output:
    """What ``embed`` and ``classify`` read from a transformers output."""

    last_hidden_state: torch.Tensor

    @property
    def logits(self) -> torch.Tensor:
        return self.last_hidden_state

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state


class OnnxModel:
    """Callable like the transformers model it was exported from; ``config`` is that model's."""

    def __init__(self, session: Any, config: Any) -> None:
        self.session = session
        self.config = config

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> _Output:
        feeds = {"input_ids": input_ids.cpu().numpy(), "attention_mask": attention_mask.cpu().numpy()}
        return _Output(torch.from_numpy(self.session.run(None, feeds)[0]))


class _First(torch.nn.Module):
    """The model's first output only, so the exported graph has one output."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]


def _modules() -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        raise OnnxUnavailable(
            f"backend: onnx needs onnxruntime and onnx (pip install 'multiplexer[onnx]'): {e}"
        ) from e
    return onnx, onnxruntime


def eager_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with eager attention where it has a choice (the shared model is left as is)."""
    model = copy.deepcopy(model)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter("eager")
        except (ValueError, ImportError) as e:  # a model without an eager path exports as it is
            config = cast("PreTrainedModel", model).config  # the setter is transformers' own
            log.info("onnx export keeps %s attention: %s", config._attn_implementation, e)
    return model


def export(model: torch.nn.Module, out: Path) -> None:
    """``model`` (CPU, fp32, eval) to ``out`` with batch and sequence axes dynamic."""
    ids = torch.tensor([[1, 2, 3, 2], [1, 3, 2, 0]])  # any vocabulary has these ids
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "output": {0: "batch"}}
    # The exporter restores the wrapper's training flag on the whole tree afterwards, and the loaded
    # model is shared: the wrapper must be in eval mode too, or the model leaves in training mode.
    wrapper = _First(model).train(model.training)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, (ids, mask), str(out), input_names=["input_ids", "attention_mask"],
                          output_names=["output"], dynamic_axes=axes, opset_version=17, dynamo=False)


def session_for(owner: object, cpu_model: torch.nn.Module, *, quantize: str | None, threads: int,
                device: torch.device, tokenize: Callable[[str], Sequence[int]]) -> OnnxModel:
    """An ONNX Runtime session for ``cpu_model``: exported (and quantised) once per owner and settings.

    ``tokenize`` (text to token ids, special tokens included) feeds int8's calibration.
    """
    _, ort = _modules()
    key = (id(owner), quantize, threads, str(device))
    with _lock:
        hit = _sessions.get(key)
        if hit is not None:
            return hit[1]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Spinning workers would burn the cores the event loop and other batches need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers: list[str | tuple[str, dict[str, int]]] = ["CPUExecutionProvider"]  # or (name, options)
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        elif device.type != "cpu":
            log.warning("backend: onnx has no %s provider here; running on the CPU", device.type)
        with tempfile.TemporaryDirectory(prefix="multiplexer-onnx-") as tmp:
            path = Path(tmp) / "model.onnx"
            export(eager_copy(cpu_model), path)
            if quantize == "int8":
                from .onnx_int8 import quantize_int8

                quantized = Path(tmp) / "model.int8.onnx"
                quantize_int8(path, quantized, tokenize)
                path = quantized
            session = ort.InferenceSession(str(path), options, providers=providers)
        model = OnnxModel(session, cpu_model.config)
        _sessions[key] = (owner, model)
        return model
