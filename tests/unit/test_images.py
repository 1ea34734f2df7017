"""Images in (issue 36), without a model: decoding and its limits, the doors' translation of image parts, the cache
key's identity rules (RAM tier and SSD file format on real mlx-lm caches), penalties ignoring key tokens, and the
text-only model's 400. The live pipeline on a tiny vision model is tests/integration/test_vision_live.py."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from cache import kvfile
from cache.prompt_cache import PromptCache
from server.core.media import (
    KEY_BASE, ImageLimits, ImageRef, PromptMedia, base64_ref, cache_key, decode, image_ref, image_spans, key_tokens,
    parts_content,
)
from server.core.request import GenerationRequest, template_message
from server.errors import InvalidRequest, PayloadTooLarge
from tests.fixtures.vision_model import data_uri, image_png

PIL = pytest.importorskip("PIL")


def png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt)
    return buf.getvalue()


# -- decoding and limits ------------------------------------------------------------------------------------------
def test_decode_gives_rgb_and_a_digest_of_the_pixels():
    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    a = decode(ImageRef(data=png(pixels)), ImageLimits())
    assert a.image.mode == "RGB" and a.image.size == (30, 20)
    same_pixels_other_file = decode(ImageRef(data=png(pixels, "BMP")), ImageLimits())
    assert same_pixels_other_file.digest == a.digest  # the picture, not its encoding
    other = pixels.copy()
    other[0, 0, 0] ^= 1
    assert decode(ImageRef(data=png(other)), ImageLimits()).digest != a.digest
    transposed = np.ascontiguousarray(pixels.reshape(30, 20, 3))  # same bytes, another shape
    assert decode(ImageRef(data=png(transposed)), ImageLimits()).digest != a.digest


BAD = {
    # name: (ref, limits, error class, words in its message)
    "not an image": (ImageRef(data=b"hello, not a picture", param="p"), ImageLimits(), InvalidRequest,
                     "could not be decoded"),
    "truncated": (ImageRef(data=image_png(1)[:60], param="p"), ImageLimits(), InvalidRequest, "could not be decoded"),
    "too many bytes": (ImageRef(data=image_png(1), param="p"), ImageLimits(max_bytes=100), PayloadTooLarge,
                       "--max-image-bytes"),
    "too many pixels": (ImageRef(data=image_png(1, (100, 100)), param="p"), ImageLimits(max_pixels=9999),
                        InvalidRequest, "--max-image-pixels"),
    "url when off": (ImageRef(url="http://127.0.0.1:9/x.png", param="p"), ImageLimits(), InvalidRequest,
                     "--allow-image-urls"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_images_are_client_errors_naming_the_parameter(name):
    ref, limits, error, words = BAD[name]
    with pytest.raises(error) as info:
        decode(ref, limits)
    assert words in info.value.message and info.value.param == "p"
    assert 400 <= info.value.status_code < 500


def test_image_refs_from_the_wire():
    data = image_png(3)
    assert image_ref(data_uri(data), "q").data == data
    assert image_ref("https://example.com/a.png", "q").url == "https://example.com/a.png"
    for bad in ("data:image/png,notbase64", "data:image/png;base64,@@@", "ftp://x/y.png", "file:///etc/passwd"):
        with pytest.raises(InvalidRequest) as info:
            image_ref(bad, "q")
        assert info.value.param == "q"
    with pytest.raises(InvalidRequest):
        base64_ref("%%%", "q")


def test_content_stays_a_string_without_images_and_keeps_order_with_them():
    assert parts_content(["a", "b"], sep="\n") == ("a\nb", [])
    one, two = ImageRef(data=b"1"), ImageRef(data=b"2")
    content, images = parts_content(["look", one, "and", "this", two], sep="\n")
    assert [p["type"] for p in content] == ["text", "image", "text", "image"]
    assert content[2]["text"] == "and\nthis" and images == [one, two]
    req = GenerationRequest(messages=(template_message("user", content), template_message("user", "x"),
                                      template_message("user", parts_content([two, one])[0])))
    assert req.images == (one, two, two, one)


# -- the cache key ------------------------------------------------------------------------------------------------
def test_key_tokens_are_past_every_vocabulary_and_fit_the_ssd_format():
    a, b = key_tokens(b"a" * 32, 64), key_tokens(b"b" * 32, 64)
    assert all(KEY_BASE <= t < 2**31 for t in a + b)
    assert a == key_tokens(b"a" * 32, 64) and len(set(a)) == 64
    assert all(x != y for x, y in zip(a, b))  # a different image differs from its first soft token on


def test_spans_and_the_key_replace_only_the_image_tokens():
    ids = [1, 2, 9, 9, 9, 3, 9, 9, 4]
    spans = image_spans(ids, 9)
    assert spans == [(2, 5), (6, 8)]
    key = cache_key(ids, spans, [b"x", b"y"])
    assert key[:2] == [1, 2] and key[5] == 3 and key[8] == 4
    assert key[2:5] == key_tokens(b"x", 3) and key[6:8] == key_tokens(b"y", 2)


WINDOWS = [
    # covered, (start, stop, first image, last image + 1) or None; spans (2, 5) and (6, 8)
    (0, (0, 8, 0, 2)),
    (3, (2, 8, 0, 2)),  # inside the first image: it is encoded whole, its embeddings used from position 3
    (5, (5, 8, 1, 2)),
    (7, (6, 8, 1, 2)),
    (8, None),
]


@pytest.mark.parametrize("covered,expected", WINDOWS)
def test_the_embedding_window_holds_whole_uncached_images(covered, expected):
    media = PromptMedia(tuple(range(9)), ((2, 5), (6, 8)), None)
    assert media.window(covered) == expected


def _caches(n: int, seed: int) -> list:
    c = KVCache()
    key = mx.random.key(seed)
    c.update_and_fetch(mx.random.normal((1, 2, n, 8), key=key), mx.random.normal((1, 2, n, 8), key=key))
    return [c]


def test_ram_tier_identity_same_image_hits_other_image_reuses_only_the_text_before_it():
    text = [5, 6, 7]
    ids = text + [9] * 4 + [8, 2]
    a = cache_key(ids, [(3, 7)], [b"A"])
    b = cache_key(ids, [(3, 7)], [b"B"])
    pc = PromptCache(1 << 20)
    pc.put(a, _caches(len(a), 0), "ns")
    assert pc.take(a + [11], "ns").length == len(a)  # the same screenshot in a later turn
    hit = pc.take(b, "ns")
    assert hit is not None and hit.length == len(text)  # another image at the same place: the text prefix only
    assert pc.take(text + [12, 13], "ns").length == len(text)  # a text-only turn shares the prefix before it
    assert pc.take(ids, "ns").length == len(text)  # the raw ids (image token id) never reach the image's KV


def test_ssd_files_carry_the_image_identity(tmp_path):
    key = cache_key([5, 6, 9, 9, 9, 7], [(2, 5)], [b"A"])
    path = tmp_path / "e.safetensors"
    kvfile.save(path, key, _caches(len(key), 1), fingerprint="fp", ns="ns")
    assert list(kvfile.load(path, expect_fingerprint="fp", expect_ns="ns").tokens) == key


# -- penalties never read a key token as a vocabulary token --------------------------------------------------------
def test_penalties_ignore_ids_past_the_vocabulary():
    from server.engine.batch.rules import Penalties, penalise, penalty_windows

    logits = mx.array([[1.0, -1.0, 2.0, 0.5]])
    rules = [Penalties(repetition=2.0, frequency=0.5)]
    plain = penalise(logits, rules, penalty_windows([[2, 1]]))
    with_key = penalise(logits, rules, penalty_windows([[2, KEY_BASE + 3, 1, KEY_BASE + 7]]))
    assert np.array_equal(np.array(plain), np.array(with_key))
    assert not np.array_equal(np.array(plain), np.array(logits))  # the rule did act on the real tokens


# -- the doors ------------------------------------------------------------------------------------------------------
def test_chat_image_url_parts_become_template_parts():
    from server.http.chat.door import chat_request
    from server.http.chat.schemas import ChatCompletionRequest

    uri = data_uri(image_png(4))
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is"},
                                     {"type": "image_url", "image_url": {"url": uri}},
                                     {"type": "text", "text": "this?"}]}]})
    req = chat_request(body, {})
    assert req.messages[0]["content"] == "be brief"
    assert [p["type"] for p in req.messages[1]["content"]] == ["text", "image", "text"]
    assert len(req.images) == 1 and req.images[0].data == image_png(4)
    assert req.images[0].param == "messages.1.content.1.image_url"


def test_responses_input_image_and_messages_image_blocks():
    from server.http.messages.schemas import MessagesRequest
    from server.http.messages.translate import messages_request
    from server.http.responses.schemas import ResponsesRequest
    from server.http.responses.translate import responses_request

    uri, raw = data_uri(image_png(5)), image_png(5)
    body = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": uri}]}]})
    req = responses_request(body, [])
    assert [r.data for r in req.images] == [raw]
    import base64

    b64 = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(raw).decode()}
    msgs = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": b64}, {"type": "text", "text": "and?"}]},
        {"role": "system", "content": "a reminder"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "here"}, {"type": "image", "source": b64}]}]}]})
    req = messages_request(msgs)
    assert [r.param for r in req.images] == ["messages.0.content.0.source.data",
                                             "messages.3.content.0.content.1.source.data"]
    tool = [m for m in req.messages if m["role"] == "tool"][0]
    assert [p["type"] for p in tool["content"]] == ["text", "image"]
    # a system turn after a user turn with an image joins it as a text part (not dropped, not hoisted)
    assert req.messages[0]["content"][-1] == {"type": "text", "text": "\n\na reminder"}


def test_text_only_model_refuses_images_and_counts_are_checked_first():
    from server.core.prompts import render_media

    class TextOnly:
        name, vision = "tiny", None

    req = GenerationRequest(messages=(template_message("user", parts_content([ImageRef(data=b"x", param="m.0")])[0]),))
    with pytest.raises(InvalidRequest) as info:
        render_media(TextOnly(), req, ImageLimits())
    assert info.value.param == "m.0" and info.value.code == "image_input_unsupported"

    class Vision:
        name, vision = "v", object()

    many = GenerationRequest(messages=(template_message("user", parts_content(
        [ImageRef(data=b"x", param=f"m.{i}") for i in range(3)])[0]),))
    with pytest.raises(InvalidRequest) as info:
        render_media(Vision(), many, ImageLimits(max_images=2))
    assert info.value.param == "m.2" and "--max-images" in info.value.message
