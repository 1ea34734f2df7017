"""OpenAI's Responses API (what Codex CLI speaks): the door, its wire types, the translation to and from the
internal request, the response object and its event stream, and the store behind previous_response_id."""
