"""The embedding model behind /v1/embeddings (model.py: the offline default, a sentence-transformers directory) and
the BERT encoder it runs (bert.py)."""

from models.embedding.model import (DEFAULT_EMBEDDING, EmbeddingModel, ensure_default_embedding_model,
                                    load_embedding_model)

__all__ = ["DEFAULT_EMBEDDING", "EmbeddingModel", "ensure_default_embedding_model", "load_embedding_model"]
