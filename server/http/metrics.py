"""/metrics: the Prometheus text of the serving counters (server.stats) and of the parts that keep their own (the
prefix cache, the SSD tier, speculation, adapters), read at scrape time. vLLM-style names under ``mlx_lane:``."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["prometheus_text"]


def prometheus_text(state) -> bytes:
    """Every series of this server, in Prometheus' text format."""
    stats = state.stats
    stats.queue_depth.set(state.lane.queue_depth)
    body = generate_latest(stats.registry) + generate_latest(_CacheCollector(state.prompt_cache.stats()))
    if stats.spec is not None:
        body += generate_latest(_SpecCollector(stats.spec.as_dict()))
    body += generate_latest(_AdapterCollector(state.adapters.stats_block()))
    if state.models is not None:
        body += generate_latest(_ModelCollector(
            state.models.stats_block(getattr(state.prompt_cache, "entries_by_namespace", dict)())))
    if state.ssd is not None:
        body += generate_latest(_SSDCollector(state.ssd.ssd_stats()))
    return body


class _CacheCollector:
    """Exposes the prompt cache's own counters (read at scrape time) as Prometheus series."""

    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        s = self.stats
        yield _counter("mlx_lane:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.get("tokens_queried", 0))
        yield _counter("mlx_lane:prefix_cache_hits", "Prompt tokens served from the prefix cache", s.get("tokens_hit", 0))
        yield _counter("mlx_lane:prefix_cache_request_queries", "Requests that looked up the prefix cache", s.get("queries", 0))
        yield _counter("mlx_lane:prefix_cache_request_hits", "Requests with a prefix-cache hit", s.get("hits", 0))
        yield _counter("mlx_lane:prefix_cache_evictions", "Prefix-cache entries evicted", s.get("evictions", 0))
        yield _gauge("mlx_lane:prefix_cache_entries", "Prefix-cache entries", s.get("entries", 0))
        yield _gauge("mlx_lane:prefix_cache_bytes", "Prefix-cache bytes in RAM", s.get("bytes", 0))
        yield _gauge("mlx_lane:prefix_cache_max_bytes", "Prefix-cache byte cap", s.get("max_bytes", 0))

    def __call__(self):  # generate_latest accepts any object with collect()
        return self


class _SpecCollector:
    """Speculative decoding counters (vLLM's spec_decode names) read at scrape time, labelled by the process's draft
    kind (``kind="mtp"``, ``"ngram"`` or ``"two-model"``: --draft-kind), so that runs of different kinds scraped
    into one Prometheus stay apart."""

    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        s = self.stats
        kind = {"kind": str(s.get("kind") or "none")}
        yield _counter("mlx_lane:spec_decode_num_drafts", "Verify rounds that carried drafts", s.get("rounds", 0),
                       kind)
        yield _counter("mlx_lane:spec_decode_num_draft_tokens", "Draft tokens proposed", s.get("drafted", 0), kind)
        yield _counter("mlx_lane:spec_decode_num_accepted_tokens", "Draft tokens accepted", s.get("accepted", 0), kind)
        yield _counter("mlx_lane:spec_decode_num_emitted_tokens", "Tokens emitted by speculative requests",
                       s.get("emitted", 0), kind)
        yield _gauge("mlx_lane:spec_decode_acceptance_rate", "Accepted / drafted so far", s.get("acceptance_rate", 0),
                     kind)
        yield _counter("mlx_lane:spec_decode_blind_starts", "Requests whose MTP heads started on a cached prefix "
                       "whose entry kept none of their state", s.get("blind", 0), kind)
        yield _counter("mlx_lane:spec_decode_solo_joined_batch", "Requests that speculated alone and joined the plain "
                       "batch, drafting no more, when others started", s.get("solo_joined_batch", 0), kind)
        b = s.get("in_batch") or {}
        yield _counter("mlx_lane:spec_decode_batch_steps", "Verify steps of speculating batches", b.get("steps", 0),
                       kind)
        yield _counter("mlx_lane:spec_decode_batch_row_steps", "Rows over those steps", b.get("row_steps", 0), kind)
        yield _counter("mlx_lane:spec_decode_batch_draft_tokens", "Draft tokens verified in batches",
                       b.get("drafted", 0), kind)
        yield _counter("mlx_lane:spec_decode_batch_accepted_tokens", "Draft tokens accepted in batches",
                       b.get("accepted", 0), kind)


class _AdapterCollector:
    """Per-adapter counters (read at scrape time), labelled by adapter name."""

    _COUNTERS = [
        ("requests", "adapter_requests", "Finished requests served through a LoRA adapter"),
        ("cache_hits", "adapter_cache_hits", "Adapter requests whose prompt was partly served by the prefix cache"),
        ("cached_tokens", "adapter_cached_tokens", "Prompt tokens of adapter requests served by the prefix cache"),
        ("prompt_tokens", "adapter_prompt_tokens", "Prompt tokens of adapter requests"),
    ]

    def __init__(self, block: dict):
        self.block = block

    def collect(self):
        for key, name, doc in self._COUNTERS:
            m = CounterMetricFamily("mlx_lane:" + name, doc, labels=["adapter"])
            for adapter, row in self.block.items():
                m.add_metric([adapter], float(row.get(key) or 0))
            yield m


class _ModelCollector:
    """Per on-demand model (server.pool), labelled by model name: loaded or not, weights, loads and requests."""

    _COUNTERS = [
        ("loads", "model_loads", "Times an on-demand model was loaded"),
        ("unloads", "model_unloads", "Times an on-demand model was unloaded (evicted, idle TTL, admin)"),
        ("requests", "model_requests", "Finished requests served by an on-demand model"),
        ("cached_tokens", "model_cached_tokens", "Prompt tokens of an on-demand model served by the prefix cache"),
        ("prompt_tokens", "model_prompt_tokens", "Prompt tokens of an on-demand model's requests"),
        ("completion_tokens", "model_completion_tokens", "Completion tokens of an on-demand model's requests"),
    ]

    def __init__(self, block: dict):
        self.block = block

    def collect(self):
        loaded = GaugeMetricFamily("mlx_lane:model_loaded", "1 while the on-demand model is loaded", labels=["model"])
        nbytes = GaugeMetricFamily("mlx_lane:model_weight_bytes", "Weights of the on-demand model (measured once "
                                   "loaded, estimated from its files before)", labels=["model"])
        entries = GaugeMetricFamily("mlx_lane:model_cache_entries", "RAM prefix-cache entries of the on-demand model",
                                    labels=["model"])
        for model, row in self.block.items():
            loaded.add_metric([model], 1.0 if row["state"] == "loaded" else 0.0)
            nbytes.add_metric([model], float(row.get("bytes") or 0))
            entries.add_metric([model], float(row.get("cache_entries") or 0))
        yield loaded
        yield nbytes
        yield entries
        for key, name, doc in self._COUNTERS:
            m = CounterMetricFamily("mlx_lane:" + name, doc, labels=["model"])
            for model, row in self.block.items():
                m.add_metric([model], float(row.get(key) or 0))
            yield m


class _SSDCollector:
    """The SSD tier's counters (read at scrape time) as Prometheus series."""

    _COUNTERS = [
        ("restores", "ssd_cache_restores", "Prefix-cache entries restored from SSD"),
        ("writes", "ssd_cache_writes", "Prefix-cache entries written to SSD"),
        ("dropped", "ssd_cache_dropped", "Pending SSD writes dropped over the pending-bytes budget"),
        ("failed", "ssd_cache_failed", "SSD disk errors (the request was served anyway)"),
        ("writes_abandoned", "ssd_cache_writes_abandoned", "SSD writes given up after retries"),
        ("removed_at_scan", "ssd_cache_removed_at_scan", "Unusable files removed by the start-up scan"),
        ("evictions", "ssd_cache_evictions", "SSD files deleted by the byte cap"),
        ("demotions", "ssd_cache_demotions", "Idle RAM entries moved to SSD"),
        ("spills", "ssd_cache_spills", "RAM evictions handed to SSD"),
        ("prefetches", "ssd_cache_prefetches", "SSD reads started before the request reached the lane"),
        ("prefetch_coalesced", "ssd_cache_prefetch_coalesced", "Prefetches that joined a read in flight"),
        ("ssd_hits", "ssd_cache_hits", "Requests whose prefix came from SSD"),
        ("ssd_tokens_hit", "ssd_cache_tokens_hit", "Prompt tokens whose KV came from SSD"),
    ]
    _GAUGES = [
        ("entries", "ssd_cache_entries", "SSD cache files"),
        ("bytes", "ssd_cache_bytes", "SSD cache bytes on disk"),
        ("max_bytes", "ssd_cache_max_bytes", "SSD cache byte cap"),
        ("pending", "ssd_cache_pending", "Cache entries waiting to be written"),
        ("restore_ms_last", "ssd_cache_restore_ms_last", "Milliseconds of the last restore"),
        ("restore_mb_s", "ssd_cache_restore_mb_per_s", "Restore throughput, MB/s (moving average)"),
        ("write_ms_last", "ssd_cache_write_ms_last", "Milliseconds of the last write (serialize + fsync)"),
    ]

    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        s = self.stats
        for key, name, doc in self._COUNTERS:
            m = CounterMetricFamily("mlx_lane:" + name, doc)
            m.add_metric([], float(s.get(key) or 0))
            yield m
        for key, name, doc in self._GAUGES:
            m = GaugeMetricFamily("mlx_lane:" + name, doc)
            m.add_metric([], float(s.get(key) or 0))
            yield m
        cost = s.get("cost_model", {})
        for key, name, doc in [("prefill_tok_s", "cost_model_prefill_tokens_per_s", "Measured prefill rate"),
                               ("read_mb_s", "cost_model_read_mb_per_s", "Measured SSD restore rate, MB/s")]:
            m = GaugeMetricFamily("mlx_lane:" + name, doc)
            m.add_metric([], float(cost.get(key) or 0))
            yield m
        m = CounterMetricFamily("mlx_lane:cost_model_decisions", "Restore-or-recompute decisions",
                                labels=["decision"])
        m.add_metric(["restore"], float(cost.get("decisions_restore") or 0))
        m.add_metric(["recompute"], float(cost.get("decisions_recompute") or 0))
        yield m


def _counter(name, doc, value, labels: dict | None = None):
    return _family(CounterMetricFamily, name, doc, value, labels)


def _gauge(name, doc, value, labels: dict | None = None):
    return _family(GaugeMetricFamily, name, doc, value, labels)


def _family(family, name, doc, value, labels: dict | None):
    m = family(name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), float(value or 0))
    return m
