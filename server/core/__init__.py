"""What every door shares: the internal request, prompt rendering and sampling parameters, constrained decoding,
output parsing, and one request's generation on the lane (its events, collected or streamed)."""
