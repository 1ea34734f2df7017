"""What a model's chat template is given for a request: its messages in the shape this model reads them, and the
template variables the request sets. Pure functions over the tokenizer (mlx-lm's ``TokenizerWrapper``) and the
internal request; every rendering of a request (server.core.prompts: the prompt, its breakpoints, where its
conversation ends; server.core.next_turn) goes through them, so they all agree on the tokens.

- ``template_messages(tokenizer, messages)``: calls to custom tools written the way the model writes them, and the
  thinking a client sent back rendered the way the model produced it (``_past_reasoning``);
- ``template_variables(req, tokenizer)``: the client's own variables, the reasoning switch and the effort level the
  template takes (server.core.template_facts).
"""

from __future__ import annotations

from server.core.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, custom_call_header
from server.core.request import REASONING_KEY, GenerationRequest
from server.core.template_facts import REASONING_FIELDS, EffortChoice, effort_level, template_facts

__all__ = ["template_messages", "template_variables", "effort_choice", "writes_hermes"]


def template_variables(req: GenerationRequest, tokenizer=None) -> dict:
    """The chat template variables a request sets besides its messages and tools: the client's own
    (``template_kwargs``), the reasoning switch (``enable_thinking``, which mlx-lm's tokenizer renames to the
    template's own when it differs) and ``reasoning_effort``, the level of the template's own the request's effort
    becomes (server.core.template_facts; not passed to a template that reads none; without a ``tokenizer``, as
    asked). An effort of ``"none"`` on a template without that level also turns thinking off, unless the request
    set the switch. A field the request leaves None is not passed, so the template's default holds."""
    out: dict = dict(req.template_kwargs)
    thinking = req.enable_thinking
    if req.reasoning_effort is not None:
        choice = effort_choice(tokenizer, req) if tokenizer is not None else EffortChoice(req.reasoning_effort,
                                                                                          req.reasoning_effort)
        if choice.level is not None:
            out["reasoning_effort"] = choice.level
        if req.reasoning_effort == "none" and choice.level != "none" and thinking is None:
            thinking = False
    if thinking is not None:
        out["enable_thinking"] = thinking
    return out


def effort_choice(tokenizer, req: GenerationRequest) -> EffortChoice:
    """The level of its own ``tokenizer``'s template gets for the request's effort (server.core.template_facts)."""
    return effort_level(template_facts(tokenizer), req.reasoning_effort)


def template_messages(tokenizer, messages) -> list[dict]:
    """The request's messages as this model's chat template is given them: calls to custom tools written the way the
    model writes them (``_custom_calls``), and past reasoning the way the template reads it (``_past_reasoning``)."""
    return _past_reasoning(tokenizer, _custom_calls(list(messages), hermes=writes_hermes(tokenizer)))


def _past_reasoning(tokenizer, messages: list[dict]) -> list[dict]:
    """Assistant turns whose thinking the client sent back (``REASONING_KEY``), rendered as the model produced it,
    so the next turn's prompt repeats the tokens of the reply and the prefix cache hits past them:

    - a template that renders past reasoning from a message field (Qwen3, GLM, gpt-oss: ``template_facts``) gets it
      in every field templates read it from (its own rules decide which turns keep it);
    - otherwise, for a model with thinking tags, the reasoning goes back into the turn's text in its tags
      (``<think>\nreasoning\n</think>\n\nanswer``), which a template that drops past thinking drops (it splits the
      text at the closing tag, as DeepSeek-R1's does) and any other renders as the model wrote it;
    - a model without thinking tags never produced it: it is left out.
    """
    if not any(REASONING_KEY in m for m in messages):
        return messages
    fields = template_facts(tokenizer).renders_reasoning
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    tagged = bool(getattr(tokenizer, "has_thinking", False) and start and end)
    out = []
    for m in messages:
        if REASONING_KEY not in m:
            out.append(m)
            continue
        m = dict(m)
        reasoning = m.pop(REASONING_KEY)
        if fields:
            m.update({name: reasoning for name in REASONING_FIELDS})
        elif tagged and reasoning and isinstance(m.get("content"), str):
            m["content"] = f"{start}\n{reasoning}\n{end}\n\n{m['content']}"
        out.append(m)
    return out


def _custom_calls(messages: list[dict], *, hermes: bool) -> list[dict]:
    """Assistant turns with calls to custom tools, in the form this model reads and writes them. A Hermes model
    writes them itself as ``<tool_call>\\n{"name": NAME}\\n<input>\\n</tool_call>`` (server.core.grammar), so
    the history shows them the same way, as the turn's own text (the next turn's prompt then repeats the tokens the
    model produced and the prefix cache hits past them); for a model with another tool-call format they become
    calls of a function whose one argument is ``input``."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or ()
        if not any(c.get("type") == "custom" for c in calls):
            out.append(m)
            continue
        m = dict(m)
        plain = [c for c in calls if c.get("type") != "custom"]
        custom = [c for c in calls if c.get("type") == "custom"]
        if hermes:
            text = "".join(f"{TOOL_CALL_OPEN}\n{custom_call_header(c['custom']['name'])}{c['custom']['input']}\n"
                           f"{TOOL_CALL_CLOSE}" for c in custom)
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
            custom = []
        m["tool_calls"] = plain + [{"id": c["id"], "type": "function", "function": {
            "name": c["custom"]["name"], "arguments": {"input": c["custom"]["input"]}}} for c in custom]
        if not m["tool_calls"]:
            del m["tool_calls"]
        out.append(m)
    return out


def writes_hermes(tokenizer) -> bool:
    """True when the model's tool calls (as mlx-lm detected them from the chat template) are Hermes ones, or
    unknown (then server/core/output_parse.py parses the Hermes format)."""
    start = getattr(tokenizer, "tool_call_start", None)
    return start is None or start == TOOL_CALL_OPEN
