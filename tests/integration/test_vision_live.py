"""Images in, end to end (issue 36): the tiny random-weight gemma3 vision model (tests/fixtures/vision_model.py)
behind a real uvicorn, through the official SDKs of the three doors (openai: chat ``image_url`` and Responses
``input_image``; anthropic: an ``image`` block).

- Every answer is mlx-vlm's own greedy text (``mlx_vlm.generate``) on the same rendered prompt and image.
- A 2-turn chat with the same image hits the prefix cache past the image (turn 2's ``cached_tokens`` covers turn 1's
  prompt); a different image at the same place reuses only the text before it; the SSD file of the conversation
  holds the image's key tokens, not the image token id.
- Bad images (not an image, too big, too many pixels, too many images, a URL while URLs are off) are each a 4xx in
  the door's error shape, and the next request is served as before; the default (text-only) model answers an
  image with a 400 in each door's shape.
"""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.fixtures.vision_model import IMAGE_TOKENS, data_uri, image_png, write_vision_model
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

pytest.importorskip("mlx_vlm")
MAX_TOKENS = 10
QUESTION = "What is in this picture?"
LIMITS = ("--max-image-bytes", "64K", "--max-image-pixels", "1000000", "--max-images", "3")


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory, default_model_dir):
    return write_vision_model(tmp_path_factory.mktemp("vision") / "tinyvision", default_model_dir)


@pytest.fixture(scope="module")
def vserver(vision_dir, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("vision-ssd")
    srv = ServerProc("--model", str(vision_dir), "--cache-bytes", "64M", "--keepalive", "1",
                     "--ssd-cache", str(ssd), "--write-behind-debounce", "0.05", *LIMITS,
                     "--ssd-restore", "always")  # every entry written: the cost model may decline a tiny model's under load
    srv.ssd = ssd
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def oracle(vision_dir):
    """mlx-vlm's own greedy text for (messages, images): the chat template rendered by its processor's tokenizer
    (content parts, ``{"type": "image"}`` where each image is), then ``mlx_vlm.generate``."""
    from mlx_vlm import generate, load
    from PIL import Image

    model, processor = load(str(vision_dir))

    def run(messages: list, pngs: list) -> str:
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
        return generate(model, processor, text, image=images, max_tokens=MAX_TOKENS, temperature=0.0).text

    return run


def oa(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def same_text(ours: str, theirs: str) -> bool:
    """mlx-lane's chat replies drop the first token's leading space (mlx-lm's detokenizer does for chat)."""
    return ours == (theirs[1:] if theirs.startswith(" ") else theirs)


def chat_user(png: bytes, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png)}},
                                        {"type": "text", "text": text}]}


def template_user(text: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def test_models_says_which_models_take_images(vserver, server):
    (card,) = httpx.get(vserver.url + "/v1/models").json()["data"]
    assert card["vision"] is True
    assert all(c.get("vision") is False for c in httpx.get(server.url + "/v1/models").json()["data"]
               if c.get("type") != "embedding")


def test_two_turn_chat_same_image_hits_the_cache_and_is_mlx_vlm_text(vserver, oracle):
    client = oa(vserver)
    picture = image_png(11)
    turn1 = [chat_user(picture)]
    r1 = client.chat.completions.create(model="tinyvision", messages=turn1, max_tokens=MAX_TOKENS, temperature=0)
    a1 = r1.choices[0].message.content
    assert same_text(a1, oracle([template_user()], [picture])), a1
    assert r1.usage.prompt_tokens > IMAGE_TOKENS
    turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Describe it again."}]
    r2 = client.chat.completions.create(model="tinyvision", messages=turn2, max_tokens=MAX_TOKENS, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens  # past the image
    expected = oracle([template_user(), {"role": "assistant", "content": a1},
                       {"role": "user", "content": "Describe it again."}], [picture])
    assert same_text(r2.choices[0].message.content, expected)


def test_a_different_image_at_the_same_place_is_no_hit(vserver, oracle):
    client = oa(vserver)
    first = client.chat.completions.create(model="tinyvision", messages=[chat_user(image_png(21), "Same words.")],
                                           max_tokens=MAX_TOKENS, temperature=0)
    other = client.chat.completions.create(model="tinyvision", messages=[chat_user(image_png(22), "Same words.")],
                                           max_tokens=MAX_TOKENS, temperature=0)
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert cached < 8, cached  # "<|im_start|>user\n" and the image's opening, never its soft tokens
    assert first.usage.prompt_tokens == other.usage.prompt_tokens
    assert same_text(other.choices[0].message.content, oracle([template_user("Same words.")], [image_png(22)]))
    assert other.choices[0].message.content != first.choices[0].message.content  # the image moves the text


def test_ssd_entries_carry_the_image_identity(vserver):
    from cache import kvfile
    from server.core.media import KEY_BASE

    oa(vserver).chat.completions.create(model="tinyvision", messages=[chat_user(image_png(31))], max_tokens=2,
                                        temperature=0)
    assert httpx.post(vserver.url + "/admin/cache/flush", timeout=30).status_code == 200
    headers = [kvfile.read_header(p) for p in vserver.ssd.rglob("*.safetensors")]
    keyed = [h for h in headers if any(t >= KEY_BASE for t in h.tokens)]
    assert keyed, "no SSD entry holds an image's key tokens"
    assert all(sum(t >= KEY_BASE for t in h.tokens) % IMAGE_TOKENS == 0 for h in keyed)


def test_responses_input_image_and_anthropic_image_block(vserver, oracle):
    picture = image_png(41)
    expected = oracle([template_user()], [picture])
    r = oa(vserver).responses.create(model="tinyvision", max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_uri(picture)},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert same_text(r.output_text, expected), r.output_text
    claude = anthropic.Anthropic(base_url=vserver.url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model="tinyvision", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert same_text(m.content[0].text, expected), m.content[0].text
    assert m.usage.cache_read_input_tokens > IMAGE_TOKENS  # the Responses request left this very prompt cached


BAD = {
    # name: (the image's data: URI or URL, status)
    "not an image": ("data:image/png;base64," + base64.b64encode(b"not a picture at all").decode(), 400),
    "too big": (None, 413),  # filled below: a noisy 200x200 PNG is ~120 KB, over the server's 64K
    "too many pixels": (None, 400),  # a flat 1100x1000 PNG: few bytes, 1.1 Mpx
    "a URL while URLs are off": ("http://127.0.0.1:9/screenshot.png", 400),
    "malformed data URI": ("data:image/png,abc", 400),
}


def _bad_uri(name: str) -> str:
    uri, _ = BAD[name]
    if name == "too big":
        return data_uri(image_png(51, (200, 200)))
    if name == "too many pixels":
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (1100, 1000), (10, 20, 30)).save(buf, format="PNG")
        return data_uri(buf.getvalue())
    return uri


@pytest.mark.parametrize("name", list(BAD))
def test_bad_images_are_4xx_in_each_doors_shape_and_nothing_else_is_disturbed(vserver, name):
    uri, status = _bad_uri(name), BAD[name][1]
    chat = httpx.post(vserver.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}],
        "max_tokens": 2})
    assert chat.status_code == status, chat.text
    assert chat.json()["error"]["param"] == "messages.0.content.0.image_url"
    resp = httpx.post(vserver.url + "/v1/responses", timeout=60, json={
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": uri}]}], "max_output_tokens": 2})
    assert resp.status_code == status and resp.json()["error"]["param"].startswith("input.0.content.0"), resp.text
    if uri.startswith("data:image/png;base64,"):
        source = {"type": "base64", "media_type": "image/png", "data": uri.split(",", 1)[1]}
    else:
        source = {"type": "url", "url": uri}
    msg = httpx.post(vserver.url + "/v1/messages", timeout=60, json={
        "model": "tinyvision", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": source}]}]})
    if name != "malformed data URI":  # Anthropic's base64 source has no URI to malform
        assert msg.status_code == status, msg.text
        assert msg.json()["type"] == "error" and msg.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(vserver.url + "/v1/chat/completions", timeout=60, json={
        "messages": [chat_user(image_png(52))], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_too_many_images(vserver):
    content = [{"type": "image_url", "image_url": {"url": data_uri(image_png(60 + i))}} for i in range(4)]
    r = httpx.post(vserver.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == 400 and "--max-images" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.3.image_url"


def test_text_only_model_refuses_images_in_each_doors_shape(server):
    uri = data_uri(image_png(70))
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                  {"type": "image_url", "image_url": {"url": uri}}]}],
        "max_tokens": 2})
    err = chat.json()["error"]
    assert chat.status_code == 400 and err["code"] == "image_input_unsupported", chat.text
    assert err["param"] == "messages.0.content.1.image_url" and "does not take images" in err["message"]
    resp = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": uri}]}], "max_output_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "image_input_unsupported", resp.text
    msg = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": uri.split(",", 1)[1]}}]}]})
    assert msg.status_code == 400 and msg.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": msg.json()["error"]["message"]}, "request_id": None}
    assert "does not take images" in msg.json()["error"]["message"]


def test_an_image_row_decodes_batched_with_text_rows(vserver):
    """Three requests at once (one with an image, two text-only) each give the text they give alone: the image
    request's prefill feeds embeddings, then its row decodes in the batch with the others."""
    from concurrent.futures import ThreadPoolExecutor

    client = oa(vserver)
    requests = [[chat_user(image_png(81), "Count the colours.")],
                [{"role": "user", "content": "Write a haiku about rivers."}],
                [{"role": "user", "content": "List three prime numbers."}]]

    def ask(messages):
        r = client.chat.completions.create(model="tinyvision", messages=messages, max_tokens=24, temperature=0)
        return r.choices[0].message.content

    def batched_ticks() -> int:
        hist = httpx.get(vserver.url + "/stats").json()["lane"]["batch_size"]["histogram"]
        return sum(v for k, v in hist.items() if int(k) >= 2)

    alone = [ask(m) for m in requests]
    httpx.post(vserver.url + "/admin/cache/clear")
    before = batched_ticks()
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(ask, requests))
    assert together == alone
    assert batched_ticks() > before  # they did share decode steps


def test_a_vision_model_in_models_dir_loads_on_demand_with_its_images(vision_dir, oracle, tmp_path):
    """The base model text-only, the vision model in ``--models-dir``: /v1/models says which takes images before the
    vision model is loaded (from its config), an image request names it and gets mlx-vlm's own text, and the same
    image sent to the base model is the 400 of a text-only model."""
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "tinyvision").symlink_to(vision_dir, target_is_directory=True)
    srv = ServerProc("--model", "default", "--models-dir", str(models_dir), "--keepalive", "1", *LIMITS)
    try:
        listed = {m["id"]: m for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]}
        assert listed["tinyvision"]["vision"] is True and listed["default"]["vision"] is False, listed
        png = image_png(91)
        messages = [chat_user(png)]
        r = oa(srv).chat.completions.create(model="tinyvision", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0)
        assert same_text(r.choices[0].message.content, oracle([template_user()], [png]))
        base = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": messages, "max_tokens": 2})
        assert base.status_code == 400 and base.json()["error"]["code"] == "image_input_unsupported", base.text
    finally:
        assert srv.stop() == 0, srv.log()
