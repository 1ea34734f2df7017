"""server.config.ServerConfig: the serve command line as one typed record. Every flag of the parser has its field
(and no field lacks its flag), so the assembly never reads a setting by guess; a parsed command line becomes the
record with its defaults, repeated flags as tuples; a namespace without the parser's flags is refused by name."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from server.cli import build_parser
from server.config import ServerConfig


def serve_flags() -> set:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest for a in sub.choices["serve"]._actions if a.dest != "help"}


def test_every_serve_flag_has_a_field_and_every_field_a_flag():
    assert {f.name for f in dataclasses.fields(ServerConfig)} == serve_flags()


def test_a_parsed_command_line_becomes_the_record(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("MLX_LANE_"):
            monkeypatch.delenv(name)
    args = build_parser().parse_args(["serve", "--port", "9001", "--model", "a=/x", "--model", "b=/y",
                                      "--kv-bits", "8", "--no-spec-batch"])
    cfg = ServerConfig.from_args(args)
    assert (cfg.port, cfg.kv_bits, cfg.kv_group_size, cfg.no_spec_batch) == (9001, 8, 64, True)
    assert cfg.model == ("a=/x", "b=/y") and cfg.pin == () and cfg.host == "127.0.0.1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


def test_a_namespace_without_the_parsers_flags_is_refused_by_name():
    with pytest.raises(ValueError, match="no .*port"):
        ServerConfig.from_args(argparse.Namespace(host="h"))


def test_serve_help_lists_the_draft_kinds_mtp_included():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    serve = sub.choices["serve"]
    kinds = next(a for a in serve._actions if a.dest == "draft_kind").choices
    assert list(kinds) == ["two-model", "ngram", "mtp", "auto"]
    assert "{two-model,ngram,mtp,auto}" in serve.format_help()


def test_float32_weights_keep_float32_matmuls_unless_the_environment_says_otherwise():
    """--dtype float32 asks MLX's CUDA backend for full float32 products (it runs them as TF32 by default);
    MLX_ENABLE_TF32 set by the user stays as it is, and other dtypes leave the environment alone."""
    from models.runtime import full_float32

    env: dict = {}
    assert full_float32("float32", env) and env == {"MLX_ENABLE_TF32": "0"}
    mine = {"MLX_ENABLE_TF32": "1"}
    assert not full_float32("float32", mine) and mine == {"MLX_ENABLE_TF32": "1"}
    for dtype in ("bfloat16", "float16", None):
        untouched: dict = {}
        assert not full_float32(dtype, untouched) and untouched == {}
