"""Build the model pool from the command line: ``--model NAME=PATH``, ``--models-dir``, ``--max-loaded-models``,
``--model-ttl``, ``--pin`` and the ``--model-alias PATTERN=NAME`` rules (server.serve calls these once at start)."""

from __future__ import annotations

import logging

from typing import Optional

from server.config import ServerConfig

log = logging.getLogger("mlx_lane")

__all__ = ["build_model_pool", "model_alias_rules", "load_slot"]


def build_model_pool(cfg: ServerConfig, flags, engine, budget, *, prepare=lambda loaded: loaded):
    """The on-demand models (server.pool): ``--model NAME=PATH`` and ``--models-dir``; None when there are none.
    Each loads on its own thread (``load_slot``), its pinned ones now; ``prepare(loaded)``: the
    server's KV scheme applied to a loaded model (its namespace)."""
    from server.pool.pool import ModelPool
    from server.pool.policy import ResidencyPolicy

    models_dir = cfg.models_dir
    if not flags.named and not models_dir:
        if cfg.pin:
            from models import ModelLoadError

            raise ModelLoadError("--pin names an on-demand model; give them with --model NAME=PATH or --models-dir")
        return None
    policy = ResidencyPolicy(budget_bytes=budget.budget_bytes, max_loaded=max(0, cfg.max_loaded_models),
                             ttl_s=max(0.0, cfg.model_ttl), fixed_bytes=engine.weights_nbytes())
    base_names = frozenset(n for n in (flags.base_name, engine.base.name, "default") if n)

    def on_unload():
        import mlx.core as mx

        mx.clear_cache()

    try:
        pool = ModelPool(flags.named, lambda name, spec: load_slot(cfg, name, spec, prepare), policy,
                         pinned=tuple(cfg.pin or ()), models_dir=models_dir, on_unload=on_unload,
                         reserved=base_names)
    except ValueError as exc:
        from models import ModelLoadError

        raise ModelLoadError(str(exc)) from None
    for entry in pool.entries():
        log.info("model %s: %s (loads on first request%s)", entry.name, entry.spec, ", pinned" if entry.pinned else "")
    pool.start()
    log.info("models: %d on demand (--max-loaded-models %d%s), base %s", len(pool.names()), cfg.max_loaded_models,
             f", --model-ttl {cfg.model_ttl:g} s" if cfg.model_ttl else "", engine.base.name)
    return pool


def model_alias_rules(cfg: ServerConfig, pool, flags) -> tuple:
    """``--model-alias PATTERN`` (onto the base model) and ``PATTERN=NAME`` (onto the on-demand model NAME), in the
    order given: the first pattern that matches a request's model name wins."""
    from models import ModelLoadError

    rules: list[tuple[str, Optional[str]]] = []
    for value in cfg.model_alias or ():
        pattern, sep, target = value.partition("=")
        pattern, target = pattern.strip(), target.strip()
        if not sep or not target or target in ("default", flags.base_name):
            rules.append((pattern if sep else value, None))
            continue
        if pool is None or not pool.knows(target):
            raise ModelLoadError(f"--model-alias {value!r}: no on-demand model named {target!r} (give it with "
                                 "--model NAME=PATH or --models-dir; a pattern without '=NAME' maps onto the base "
                                 "model)")
        rules.append((pattern, target))
    return tuple(rules)


def load_slot(cfg: ServerConfig, name: str, spec: str, prepare=lambda loaded: loaded):
    """Load an on-demand model (a pool loader thread): weights, its KV scheme, its KV price, one warm forward."""
    import mlx.core as mx

    from models import load_model
    from server.engine.slot import ModelSlot

    loaded = prepare(load_model(spec, cfg.dtype, progress=False, source=cfg.model_source))
    slot = ModelSlot(loaded, name=name, base=False, kv_bits=cfg.kv_bits,
                     kv_group_size=cfg.kv_group_size,
                     read_shared_prefix=not cfg.debug_copy_hits)
    slot.measure_kv()  # traced, not run (ModelSlot.measure_kv)
    mx.eval(slot.model(mx.array([[1]]), cache=slot.new_caches()))  # a warm forward: its first request pays no first call
    mx.clear_cache()
    return slot
