"""Loading and conversion: a spec (a directory, a .gguf file, a packaged name, a repo id) -> a ready mlx-lm model
(load.py), GGUF -> mlx-lm without torch (gguf.py, gguf_arch.py, gguf_tokenizer.py), the offline default and
packaged models (default.py, packaged.py), the fingerprint a model's KV is cached under (fingerprint.py), LoRA
adapters (adapters.py), a process's shard of a model (sharding.py), and where downloads live (home.py, hashing.py,
progress.py). The package's public API is re-exported by ``models``."""
