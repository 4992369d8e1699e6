"""``quantize: int8``: dynamic int8 quantisation of an exported encoder, with its outlier channels kept fp32.

ONNX Runtime's dynamic quantisation gives each matrix product's input one
scale per call (the whole batch), and BERT-style encoders put a few huge values
in a few fixed channels (the ``[CLS]`` token's, up to 20x the other channels'
largest): quantising every weight product measured a worst cosine of 0.972
against sentence-transformers on the bench texts. So, as measured on
``all-MiniLM-L6-v2`` (bench texts of 3 to 120 words, five seeds):

- the feed-forward's inputs are split: their ``OUTLIER_CHANNELS`` channels with
  the largest values on a fixed calibration text (this module's, tokenised by
  the model's tokenizer; the same on every load) are zeroed for the int8
  product and multiplied in fp32 against the same weight rows, then added back;
- the value projections stay fp32 (alone they cost as much cosine as the rest
  of the attention together); queries, keys and the attention output are int8;
- weights are int8 per output channel in 7 bits (``reduce_range``): without
  VNNI, ONNX Runtime's u8 x s8 kernel adds pairs of products in 16 bits, and
  full 8-bit weights overflowed it (worst cosine 0.94).

Worst cosine 0.993; fastest of the recipes tried that keep 0.99 (see docs/local-models.md).
A graph without BERT's layer names has every weight product quantised, each
input split.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

OUTLIER_CHANNELS = 4
FP32 = re.compile(r"/attention/self/value/MatMul$")  # value projections
SPLIT = re.compile(r"/layer\.\d+/(intermediate|output)/dense/MatMul$")  # the feed-forward's two products
CALIBRATION = (
    "The gateway batches calls from many clients into few upstream requests.",
    "hi",
    "A cat sat on the mat, and 42 dogs watched it from 1,250 metres away.",
    "Search results, reviews and product descriptions are embedded once and compared many times.",
    "What is the capital of France? Paris has been the capital since the tenth century.",
    "Error: connection refused (errno 111) after 3 retries; giving up at 12:04:59.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
)


def _weight_matmuls(graph: Any) -> list[Any]:
    weights = {w.name for w in graph.initializer}
    return [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def plan(graph: Any) -> tuple[list[str], list[str]]:
    """The MatMul nodes to quantise, and those of them whose input is split (see the module docstring)."""
    matmuls = [n.name for n in _weight_matmuls(graph)]
    if not any(SPLIT.search(n) for n in matmuls):
        return matmuls, matmuls
    quantised = [n for n in matmuls if not FP32.search(n)]
    return quantised, [n for n in quantised if SPLIT.search(n)]


def calibration_rows(tokenize: Callable[[str], Sequence[int]]) -> list[list[int]]:
    """Token ids of the calibration texts: each alone, and all of them as one long text."""
    return [list(tokenize(t)) for t in (*CALIBRATION, " ".join(CALIBRATION))]


def channel_peaks(src: Path, tensors: Sequence[str],
                  rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Largest absolute value per channel of each of ``tensors``, over the rows run one at a time (fp32)."""
    model = onnx.load(str(src))
    for name in tensors:
        model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    peaks: dict[str, np.ndarray] = {}
    for row in rows:
        ids = np.asarray([row], dtype=np.int64)
        values = session.run(list(tensors), {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        for name, value in zip(tensors, values, strict=True):
            peak = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
            peaks[name] = np.maximum(peaks[name], peak) if name in peaks else peak
    return peaks


def split_outliers(model: Any, nodes: Sequence[str], peaks: dict[str, np.ndarray]) -> None:
    """Each node in ``nodes`` (x @ W) becomes (x with its peak channels zeroed) @ W + x[peaks] @ W[peaks].

    The fp32 term is added after the node's bias Add where there is one, so
    ONNX Runtime still fuses the bias into the quantised product.
    """
    graph = model.graph
    weights = {w.name: w for w in graph.initializer}
    consumers: dict[str, list[Any]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    chosen = set(nodes)
    ordered: list[Any] = []
    split_inputs: set[str] = set()
    add_after: dict[str, Any] = {}  # node name -> the Add that follows it
    for node in graph.node:
        if node.name in chosen:
            x, name = node.input[0], node.name
            key = x.strip("/").replace("/", "_")
            channels = np.sort(np.argsort(-peaks[x], kind="stable")[:OUTLIER_CHANNELS]).astype(np.int64)
            if x not in split_inputs:
                split_inputs.add(x)
                keep = np.ones(peaks[x].shape[0], dtype=np.float32)
                keep[channels] = 0.0
                graph.initializer.extend([numpy_helper.from_array(keep, f"{key}_inlier_mask"),
                                          numpy_helper.from_array(channels, f"{key}_outlier_channels")])
                ordered += [
                    helper.make_node("Mul", [x, f"{key}_inlier_mask"], [f"{key}_inliers"],
                                     name=f"{key}_inliers"),
                    helper.make_node("Gather", [x, f"{key}_outlier_channels"], [f"{key}_outliers"], axis=-1,
                                     name=f"{key}_outliers"),
                ]
            w = numpy_helper.to_array(weights[node.input[1]])
            graph.initializer.append(numpy_helper.from_array(w[channels], f"{name}_outlier_weight"))
            node.input[0] = f"{key}_inliers"
            term = helper.make_node("MatMul", [f"{key}_outliers", f"{name}_outlier_weight"],
                                    [f"{name}_outlier"], name=f"{name}_outlier_matmul")
            ordered += [node, term]
            after = consumers[node.output[0]]
            last = after[0] if len(after) == 1 and after[0].op_type == "Add" else node
            total = last.output[0]
            last.output[0] = f"{total}_inliers"
            add_after[last.name] = helper.make_node("Add", [f"{total}_inliers", f"{name}_outlier"], [total],
                                                    name=f"{name}_outlier_add")
        else:
            ordered.append(node)
        if node.name in add_after:
            ordered.append(add_after.pop(node.name))
    del graph.node[:]
    graph.node.extend(ordered)


def quantize_int8(src: Path, dst: Path, tokenize: Callable[[str], Sequence[int]]) -> None:
    """``src`` (an fp32 export) to ``dst`` with the recipe of the module docstring; deterministic."""
    model = onnx.load(str(src))
    quantised, split = plan(model.graph)
    inputs = sorted({n.input[0] for n in model.graph.node if n.name in set(split)})
    peaks = channel_peaks(src, inputs, calibration_rows(tokenize))
    split_outliers(model, split, peaks)
    quantize_dynamic(model, str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                     op_types_to_quantize=["MatMul"], nodes_to_quantize=quantised,
                     extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
