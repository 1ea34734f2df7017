"""The model mechanism behind the lane's plans: the engine's verbs (engine.py), prefill (prefill.py), decoding
(decode.py) over the decode batches (batch/), one model's facts (slot.py), speculation, sampling, the KV layout and
the process group of a sharded model. Lane thread only."""
