"""The generation lane: one thread that owns all model compute. The scheduler plans each tick (scheduler.py ->
plan.py), the lane executes the plan through the engine (lane.py), and each request is one Sequence with one
lifecycle (sequence.py). Policy lives here; the model mechanism is server.engine."""
