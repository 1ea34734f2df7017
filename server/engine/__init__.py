"""The model mechanism behind the lane's plans: the engine's verbs (engine.py), the decode batches (batch.py), the
solo decoder (solo.py), speculation, sampling, the KV layout and the process group of a sharded model. Lane thread
only."""
