"""``POST /tokenize`` and ``POST /detokenize``: a model's own tokenizer and chat template, in vLLM's and llama.cpp's
shapes (both at once where they do not conflict).

/tokenize takes one of three inputs, told apart by the field that carries it:

- ``messages`` (vLLM's chat form): a chat rendered exactly as ``/v1/chat/completions`` renders it (the chat door's
  translation, then server.core.prompts.render_chat: the model's template, ``tools`` / ``tool_choice``, the
  generation prompt), so ``count`` is what that chat completion reports as ``usage.prompt_tokens``.
  ``add_generation_prompt`` (default true); ``continue_final_message`` (default false: the last message is left
  open for the model to continue, with no generation prompt after it); ``add_special_tokens`` (default false: the
  template writes its own; true also adds the tokenizer's, e.g. a BOS, around the rendered text, as vLLM does).
- ``prompt`` (vLLM's text form): text; ``add_special_tokens`` (default true).
- ``content`` (llama.cpp): text; ``add_special`` (default false), ``parse_special`` (default true; false: text that
  spells a special token, e.g. ``<|im_start|>``, is tokenized as plain text).

Either text form also takes the other's switch names (``add_special_tokens`` wins over ``add_special``). Every form:
``return_token_strs`` (vLLM: ``token_strs``, the tokenizer's own strings of the tokens) and ``with_pieces``
(llama.cpp: each of ``tokens`` is ``{"id", "piece"}``, the piece the token's text alone, or its bytes as a list of
ints when they are not UTF-8 by themselves). The answer is vLLM's body ``{"count", "max_model_len", "tokens"}``,
whose ``tokens`` is llama.cpp's.

/detokenize: ``{"tokens": [ids]}`` -> ``{"prompt": text, "content": text}`` (vLLM's and llama.cpp's names of the
same text; special tokens are written out, as both do). An id outside the tokenizer's vocabulary is a 400.

``model`` selects the model as a generation does (server.http.target): absent, the base model; a name the server
does not answer to, a 404. Tokenizing runs off the event loop.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Annotated, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, Strict
from starlette.concurrency import run_in_threadpool

from server.core.prompts import render_chat, render_chat_text
from server.errors import InvalidRequest
from server.http.chat.door import chat_request
from server.http.chat.schemas import ChatCompletionRequest
from server.http.target import resolve_target
from server.http.wire import json_response, read_json, validate_body

__all__ = ["router", "TokenizeChatRequest", "TokenizeTextRequest", "DetokenizeRequest", "tokenize_chat",
           "tokenize_text", "answer", "detokenize", "piece_of"]

router = APIRouter()

TokenIds = list[Annotated[int, Strict()]]


class _Options(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of the other server's shape we do not read are ignored

    return_token_strs: bool = False
    with_pieces: bool = False


class TokenizeTextRequest(_Options):
    model: Optional[str] = None
    prompt: Optional[str] = None  # vLLM
    content: Optional[str] = None  # llama.cpp
    add_special_tokens: Optional[bool] = None  # vLLM's name (default true)
    add_special: Optional[bool] = None  # llama.cpp's name (default false)
    parse_special: bool = True

    def text(self) -> str:
        if self.prompt is not None and self.content is not None:
            raise InvalidRequest("send the text to tokenize as 'prompt' or as 'content', not both", param="prompt")
        if self.prompt is None and self.content is None:
            raise InvalidRequest("'prompt' (or 'content') must be a string", param="prompt")
        return self.prompt if self.prompt is not None else self.content

    def adds_special(self) -> bool:
        """Add the tokenizer's special tokens (e.g. a BOS)? Each shape's own default: vLLM's yes, llama.cpp's no."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        if self.add_special is not None:
            return self.add_special
        return self.prompt is not None


class TokenizeChatRequest(_Options, ChatCompletionRequest):
    """A chat completions body (messages, tools, tool_choice ...) plus vLLM's rendering switches."""

    add_generation_prompt: Optional[bool] = None  # default true (false with continue_final_message)
    continue_final_message: bool = False
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    tokens: TokenIds = Field(max_length=1_000_000)


def tokenize_chat(tokenizer, body: TokenizeChatRequest) -> list[int]:
    """The token ids a chat completion of ``body``'s messages and tools would compute (with the default switches)."""
    generation_prompt = body.add_generation_prompt
    if body.continue_final_message and generation_prompt:
        raise InvalidRequest("continue_final_message leaves the last message open: it cannot be followed by the "
                             "generation prompt; send add_generation_prompt false (or leave it out)",
                             param="continue_final_message")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise InvalidRequest("continue_final_message continues the last message, which must be the assistant's",
                             param="continue_final_message")
    switches = dict(add_generation_prompt=generation_prompt if generation_prompt is not None
                    else not body.continue_final_message, continue_final_message=body.continue_final_message)
    req = chat_request(body, {})
    if body.add_special_tokens:
        return list(tokenizer.encode(render_chat_text(tokenizer, req, **switches), add_special_tokens=True))
    return render_chat(tokenizer, req, **switches)


def tokenize_text(tokenizer, body: TokenizeTextRequest) -> list[int]:
    text, special = body.text(), body.adds_special()
    if body.parse_special:
        return list(tokenizer.encode(text, add_special_tokens=special))
    return list(tokenizer.encode(text, add_special_tokens=special, split_special_tokens=True))


def answer(tokenizer, ids: list[int], context_length: int, body: _Options) -> dict:
    """vLLM's tokenize response (+ llama.cpp's pieces when asked)."""
    tokens = [{"id": i, "piece": piece_of(tokenizer, i)} for i in ids] if body.with_pieces else ids
    out = {"count": len(ids), "max_model_len": context_length, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = list(tokenizer.convert_ids_to_tokens(ids))
    return out


def detokenize(tokenizer, ids: list[int], model: str) -> str:
    """The text of ``ids`` (special tokens written out); an id outside the tokenizer's vocabulary is a 400 (a
    tokenizer decodes it as nothing, silently)."""
    size = len(tokenizer)
    bad = next((i for i in ids if not 0 <= i < size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is not in the vocabulary of '{model}' (ids 0 to {size - 1})",
                             param="tokens")
    return tokenizer.decode(ids)


def piece_of(tokenizer, token_id: int) -> Union[str, list[int]]:
    """One token's text as llama.cpp's ``piece``: a string, or the token's bytes when they are not UTF-8 alone
    (part of a character): byte-level BPE tokens (GPT-2's byte alphabet) and SentencePiece byte tokens
    (``<0xC3>``) are read back to their bytes."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    raw = _token_bytes(tokenizer.convert_ids_to_tokens(token_id))
    if raw is None:
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(token: Optional[str]) -> Optional[bytes]:
    if not token:
        return None
    byte = _BYTE_TOKEN.fullmatch(token)
    if byte:
        return bytes([int(byte.group(1), 16)])
    table = _byte_alphabet()
    if all(c in table for c in token):
        return bytes(table[c] for c in token)
    return None


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the others
    (controls, space, 0x7F-0xA0, 0xAD) for 256 + their index among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _schema_of(obj: dict):
    chat = "messages" in obj
    text = "prompt" in obj or "content" in obj
    if chat and text:
        raise InvalidRequest("send either 'messages' (a chat, rendered with the model's template) or text "
                             "('prompt' or 'content'), not both", param="messages")
    if not (chat or text):
        raise InvalidRequest("nothing to tokenize: send 'prompt' or 'content' (text), or 'messages' (a chat, "
                             "rendered with the model's template)", param="prompt")
    return TokenizeChatRequest if chat else TokenizeTextRequest


@router.post("/tokenize")
async def tokenize_endpoint(request: Request):
    state = request.app.state.lane_state
    obj = await read_json(request, state.max_body_bytes)
    body = validate_body(obj, _schema_of(obj))
    target = await resolve_target(state, body.model)
    try:
        tok = target.tokenizer
        work = tokenize_chat if isinstance(body, TokenizeChatRequest) else tokenize_text
        ids = await run_in_threadpool(work, tok, body)
        out = await run_in_threadpool(answer, tok, ids, target.slot.context_length, body)
    finally:
        target.release()
    return json_response(out)


@router.post("/detokenize")
async def detokenize_endpoint(request: Request):
    state = request.app.state.lane_state
    body = validate_body(await read_json(request, state.max_body_bytes), DetokenizeRequest)
    target = await resolve_target(state, body.model)
    try:
        text = await run_in_threadpool(detokenize, target.tokenizer, body.tokens, target.name)
    finally:
        target.release()
    return json_response({"prompt": text, "content": text})
