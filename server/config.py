"""The ``serve`` command's settings as one typed, frozen record: ``ServerConfig``, built once from argparse.

``server.cli`` parses the flags (and their ``MLX_LANE_<FLAG>`` environment defaults); ``ServerConfig.from_args``
turns the namespace into this record, and the assembly (server.serve, server.pool.build) reads only it: every
setting has one name and one type here, and a flag added to the parser without a field here fails the unit test
that holds the two together (tests/unit/test_server_config.py) instead of being read by ``getattr`` with a guess.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    # -- models ----------------------------------------------------------------------------------------------------
    model: tuple[str, ...]  # --model [NAME=]PATH, repeated
    models_dir: Optional[str]
    max_loaded_models: int
    model_ttl: float
    pin: tuple[str, ...]
    model_alias: tuple[str, ...]
    adapter: tuple[str, ...]  # --adapter NAME=PATH, repeated
    adapter_dir: Optional[str]
    embedding_model: Optional[str]
    embedding_max_tokens: int
    dtype: Optional[str]
    model_source: str  # --model-source: auto | mlx-lm | mlx-vlm (models.loading.vlm_text)
    # -- the HTTP side ---------------------------------------------------------------------------------------------
    host: str
    port: int
    api_key: Optional[str]
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]
    keep_billing_header: bool
    no_dashboard: bool
    ignore_model_defaults: bool  # the API's sampling defaults, not the model's generation_config.json
    no_next_turn_cache: bool  # no next-turn cache entries computed ahead (server.core.next_turn)
    max_queue: int
    max_body_bytes: int
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    allow_image_urls: bool
    default_max_tokens: Optional[int]
    keepalive: float
    shutdown_timeout: float
    log_level: str
    # -- the prefix cache ------------------------------------------------------------------------------------------
    cache_bytes: Optional[int]
    ssd_cache: Optional[str]
    no_ssd_cache: bool
    ssd_cache_bytes: Optional[int]
    write_behind_debounce: float
    ssd_write_when: str  # --ssd-write-when: always | idle
    ssd_restore: str
    demote_idle: float
    # -- speculation -----------------------------------------------------------------------------------------------
    draft_model: Optional[str]
    draft_kind: Optional[str]
    num_draft_tokens: Optional[int]
    no_spec_batch: bool
    # -- the engine ------------------------------------------------------------------------------------------------
    batch_layout: str
    attention: str
    kernels: str
    kv_bits: Optional[int]
    kv_group_size: int
    prefill_chunk: Optional[int]
    max_batch: Optional[int]
    prefill_batch: Optional[int]
    prefill_together_max: Optional[int]  # --prefill-together-max (None: the device's default)
    memory_budget: Optional[int]
    cuda_pool_keep: Optional[int]  # --cuda-pool-keep: bytes the CUDA pool keeps freed (None: the driver's default)
    pipeline: bool
    warm_up: str  # --warm-up: before-ready | behind | off (server.lane.warm)
    kernel_warmers: Optional[int]  # --kernel-warmers: None = auto (server.startup.warmers)
    # -- to compare and to debug -----------------------------------------------------------------------------------
    debug_copy_hits: bool
    debug_no_draft_batch: bool
    debug_gpu_attention_split: int
    debug_gpu_attention_unroll: int
    debug_gpu_attention_composed_max: int
    debug_gpu_attention_prefill_max: int
    debug_cudnn_buckets: str  # "Q,K" (server.cli checks it); "0,0": off
    debug_no_conv_kernel: bool
    debug_moe_sort_min: int
    debug_moe_dense_max: int
    debug_ssd_host_copies: bool
    debug_trace_collectives: bool
    debug_cuda_profile_steps: str
    debug_keep_prefill_buffers: bool
    debug_prefill_wait: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        """The record of a parsed ``serve`` command line (repeated flags become tuples)."""
        given = vars(args)
        missing = [f.name for f in fields(cls) if f.name not in given]
        if missing:
            raise ValueError(f"the serve command line has no {', '.join(missing)}: build the namespace with "
                             "server.cli.build_parser()")
        values = {f.name: given[f.name] for f in fields(cls)}
        for name, value in values.items():
            if isinstance(value, list):
                values[name] = tuple(value)
        return cls(**values)
