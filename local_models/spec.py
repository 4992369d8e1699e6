"""Per-model configuration (``providers.<name>.models.<model>``), torch-free so config parsing stays light."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from multiplexer.core.paths import base_dir

Task = Literal["embed", "classify", "generate"]
DType = Literal["auto", "float32", "fp32", "float16", "fp16", "half", "bfloat16", "bf16", "float64"]
Backend = Literal["torch", "onnx"]
Pooling = Literal["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="package:<module>, a model directory (relative: to the config's"
                                    " folder), or a cached Hugging Face id")
    task: Task
    device: str = "auto"
    dtype: DType = "auto"
    max_batch_size: int = Field(default=64, ge=1, description="rows per forward pass")
    max_tokens: int = Field(default=16384, ge=16, description="padded tokens per batch: rows x longest")
    max_wait_ms: float = Field(default=2.0, ge=0)
    max_length: int | None = Field(default=None, ge=1, description="input limit, at most the model's own")
    max_padding: float | None = Field(
        default=None, ge=0, le=1,
        description="padding share tolerated when grouping; unset: 0.1, or no limit where the forward"
                    " skips padding (BERT encoders unpadded on a CPU, eager)",
    )
    padding_slack: int = Field(default=16, ge=0, description="padding tokens a batch may always carry")
    length_grouping: bool = True
    aging_s: float = Field(default=1.0, ge=0, description="waiting time worth one priority level")
    concurrency: int | None = Field(
        default=None, ge=1,
        description="batches running at once on this model; unset: one per core on CPU (up to 4), 1 on GPU",
    )
    truncate: bool = False
    unpadded: bool = Field(default=True, description="BERT encoders: linear layers skip padding tokens")
    compile: bool | Literal["auto"] = Field(
        default="auto",
        description="torch.compile the forward (embed, classify). true: in the background, eager until it is"
                    " warm, its timing against the eager forward recorded on disk. auto: at load, before the"
                    " model is ready, only where such a record says faster on this processor and torch, a C++"
                    " compiler exists and the eager forward kept torch's linear layers; kept only where"
                    " timing agrees, a failure logged quietly",
    )
    linear: Literal["auto", "torch", "onednn"] = Field(
        default="auto",
        description="CPU fp32 linear layers: torch's BLAS, or oneDNN with weights packed once; auto"
                    " times both on the model's widest layer at load and keeps the faster (embed, classify;"
                    " not with compile, whose inductor packs weights its own way)",
    )
    backend: Backend = Field(
        default="torch", description="onnx: exported at load time and run by ONNX Runtime (the onnx extra)",
    )
    quantize: Literal["int8"] | None = Field(
        default=None, description="backend onnx: dynamic int8 quantisation (value projections stay fp32, "
                                  "the feed-forward's outlier channels too)",
    )
    pooling: Pooling | list[Pooling] | None = None
    normalize: bool | None = None
    max_new_tokens: int = Field(default=64, ge=1)
    max_new_tokens_limit: int = Field(default=2048, ge=1)

    @field_validator("source")
    @classmethod
    def _directory_beside_config(cls, source: str, info: ValidationInfo) -> str:
        """A relative directory is the config folder's: written ``./x`` (always a directory), or a
        name that is a directory there (else it stays a Hugging Face id, ``org/name``)."""
        base = base_dir(info)
        if base is None or source.startswith(("package:", "hf:", "/", "~")):
            return source
        if source.startswith(".") or (base / source).is_dir():
            return str(base / source)
        return source

    @model_validator(mode="after")
    def _backend_fits(self) -> ModelSpec:
        if self.backend == "onnx":
            if self.task == "generate":
                raise ValueError("backend: onnx serves embed and classify models, not generate")
            if self.dtype not in ("auto", "float32", "fp32"):
                raise ValueError("backend: onnx runs in float32 (use quantize: int8 for a smaller model)")
        elif self.quantize is not None:
            raise ValueError("quantize needs backend: onnx")
        return self
