"""/stats' http block: responses counted by status code (the dashboard's errors by status)."""

from server.stats import ServingStats


def test_http_block_counts_by_status_and_errors():
    stats = ServingStats()
    assert stats.http_block() == {"responses": 0, "errors": 0, "by_status": {}}
    for code in (200, 200, 403, 429, 500, 204):
        stats.on_http_status(code)
    assert stats.http_block() == {"responses": 6, "errors": 3,
                                  "by_status": {"200": 2, "204": 1, "403": 1, "429": 1, "500": 1}}
