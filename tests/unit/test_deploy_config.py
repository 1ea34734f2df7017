"""deploy/haproxy.cfg.in as deploy/cluster.py renders it: every placeholder filled, and a real HAProxy accepts both
balance policies (`haproxy -c`). No model, no replicas: the live behaviour is tests/integration/test_cluster_live.py."""

from __future__ import annotations

import re
import subprocess

import pytest

from deploy.cluster import BALANCES, ClusterError, haproxy_binary, render_config

BACKENDS = [("r1", "127.0.0.1:18081"), ("r2", "10.0.0.2:8081")]


@pytest.mark.parametrize("balance,factor", [("session", 0), ("session", 150), ("roundrobin", 0)])
def test_the_rendered_config_is_complete_and_haproxy_accepts_it(tmp_path, balance, factor):
    text = render_config(BACKENDS, bind="127.0.0.1:18080", run_dir=tmp_path, balance=balance,
                         hash_balance_factor=factor)
    assert ("hash-balance-factor 150" in text) == bool(factor)
    assert not re.search(r"@[A-Z_]+@", text), "a placeholder was left unfilled"
    assert "server r2 10.0.0.2:8081 track by_session/r2" in text
    assert f"balance {BALANCES[balance][0]}" in text and f"balance {BALANCES[balance][1]}" in text
    try:
        haproxy = haproxy_binary()
    except ClusterError as exc:
        pytest.skip(str(exc))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_an_unknown_balance_or_a_factor_below_100_is_refused(tmp_path):
    with pytest.raises(ValueError, match="balance must be one of"):
        render_config(BACKENDS, bind="127.0.0.1:1", run_dir=tmp_path, balance="random")
    with pytest.raises(ValueError, match="above 100"):
        render_config(BACKENDS, bind="127.0.0.1:1", run_dir=tmp_path, hash_balance_factor=90)
