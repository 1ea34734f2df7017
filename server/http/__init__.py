"""The HTTP room: the FastAPI app, the guard in front of it, and one door per API, all run by one pipeline.

Each generating door (``chat/``, ``responses/``, ``messages/``) parses its wire body with its own schemas into the
internal request (server.core.request) and formats the generation's events in its API's shape; server.http.pipeline
runs the same steps for all of them. The map of the whole package is in server/__init__.py.
"""
