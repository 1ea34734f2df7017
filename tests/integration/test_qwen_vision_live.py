"""Images with multimodal rotary positions, end to end (issue 46): the tiny random-weight Qwen3.5 image-text model
(tests/fixtures/qwen_vision_model.py) behind a real uvicorn with ``--model-source mlx-vlm`` (its language model from
mlx-vlm, which reads each image token's (t, h, w) position and the shifted positions of the text after it), through
the official SDKs of the three doors.

- chat ``image_url``, Responses ``input_image`` and Messages ``image`` each answer mlx-vlm's own greedy text
  (``mlx_vlm.generate`` on the same rendered prompt and image);
- a 2-turn chat resending the same image hits the prefix cache past the image (turn 2's ``cached_tokens`` covers
  turn 1's prompt but its last token: the checkpoint of the recurrent state there) and is still mlx-vlm's text: the
  positions after the image go on from the cached ones, shifted as the image shifted them.
"""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.fixtures.qwen_vision_model import write_qwen_vision_model
from tests.fixtures.vision_model import data_uri, image_png
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

pytest.importorskip("mlx_vlm")
MAX_TOKENS = 10
QUESTION = "What is in this picture?"
NAME = "tinyqwenvl"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, default_model_dir):
    return write_qwen_vision_model(tmp_path_factory.mktemp("qwen-vision") / NAME, default_model_dir)


@pytest.fixture(scope="module")
def qserver(qwen_dir):
    srv = ServerProc("--model", str(qwen_dir), "--model-source", "mlx-vlm", "--cache-bytes", "64M")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def oracle(qwen_dir):
    """mlx-vlm's own greedy text for (messages, images): the chat template rendered by its processor's tokenizer,
    then ``mlx_vlm.generate``."""
    from mlx_vlm import generate, load
    from PIL import Image

    model, processor = load(str(qwen_dir))

    def run(messages: list, pngs: list) -> str:
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
        return generate(model, processor, text, image=images, max_tokens=MAX_TOKENS, temperature=0.0).text

    return run


def same_text(ours: str, theirs: str) -> bool:
    """mlx-lane's chat replies drop the first token's leading space (mlx-lm's detokenizer does for chat)."""
    return ours == (theirs[1:] if theirs.startswith(" ") else theirs)


def chat_user(png: bytes, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png)}},
                                        {"type": "text", "text": text}]}


def template_user(text: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def test_models_says_it_takes_images_and_computes_with_mlx_vlm(qserver):
    (card,) = httpx.get(qserver.url + "/v1/models").json()["data"]
    assert (card["vision"], card["architecture"], card["source"]) == (True, "qwen3_5", "mlx-vlm"), card


def test_two_turn_chat_same_image_hits_the_cache_and_is_mlx_vlm_text(qserver, oracle):
    client = OpenAI(base_url=qserver.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    picture = image_png(11)
    turn1 = [chat_user(picture)]
    r1 = client.chat.completions.create(model=NAME, messages=turn1, max_tokens=MAX_TOKENS, temperature=0)
    a1 = r1.choices[0].message.content
    assert same_text(a1, oracle([template_user()], [picture])), a1
    turn2 = turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Describe it again."}]
    r2 = client.chat.completions.create(model=NAME, messages=turn2, max_tokens=MAX_TOKENS, temperature=0)
    # past the image: from turn 1's prompt-boundary entry at least (a hybrid's state is kept at that checkpoint;
    # the random model's reply need not tokenize back to the tokens it generated)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1
    expected = oracle([template_user(), {"role": "assistant", "content": a1},
                       {"role": "user", "content": "Describe it again."}], [picture])
    assert same_text(r2.choices[0].message.content, expected)


def test_responses_input_image_and_anthropic_image_block(qserver, oracle):
    picture = image_png(41)
    expected = oracle([template_user()], [picture])
    client = OpenAI(base_url=qserver.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model=NAME, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_uri(picture)},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert same_text(r.output_text, expected), r.output_text
    claude = anthropic.Anthropic(base_url=qserver.url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model=NAME, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert same_text(m.content[0].text, expected), m.content[0].text
    assert m.usage.cache_read_input_tokens > 0  # the Responses request left this very prompt cached
