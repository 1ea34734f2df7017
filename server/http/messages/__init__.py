"""Anthropic's Messages API (what Claude Code speaks): the door, its wire types, the translation to the internal
request, and the message object and its event stream."""
