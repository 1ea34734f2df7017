"""OpenAI's chat completions and text completions: the doors (door.py), their wire types (schemas.py) and their
response objects and SSE chunks (format.py)."""
