"""POST /v1/embeddings on the offline default all-MiniLM-L6-v2 through the shared live server (issue 17).

The oracle is transformers + torch on the same directory (BertModel, mean pooling over the attention mask, L2
normalization: what sentence-transformers' modules.json for this model says), test environment only."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.model

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "Un chat dort sur le canapé, près de la fenêtre ouverte.",
    "def add(a, b):\n    return a + b",
]


def embed(url, body):
    return httpx.post(url + "/v1/embeddings", json=body, timeout=120)


@pytest.mark.oracle
def test_vectors_match_transformers_mean_pooling(server):
    torch = pytest.importorskip("torch")
    from transformers import AutoModel, AutoTokenizer

    from models.embedding import ensure_default_embedding_model

    path = str(ensure_default_embedding_model(progress=False))
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()

    r = embed(server.url, {"input": SENTENCES, "model": "all-MiniLM-L6-v2"})
    assert r.status_code == 200, r.text
    body = r.json()
    got = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)
    assert got.shape == (len(SENTENCES), 384)
    assert np.abs(got - ref).max() < 1e-4
    assert body["usage"]["prompt_tokens"] == int(enc["attention_mask"].sum())


def test_openai_client_float_and_base64_and_cosine_ranks_related_first(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    res = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[:3])  # the client asks for base64
    vecs = np.array([d.embedding for d in res.data])
    assert vecs.shape == (3, 384) and res.usage.prompt_tokens > 0
    sims = vecs @ vecs.T
    assert sims[0, 1] > sims[0, 2] + 0.3  # eating food ~ eating bread, far from the movie
    flt = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[0], encoding_format="float")
    assert np.allclose(flt.data[0].embedding, vecs[0], atol=1e-6)

    r = embed(server.url, {"input": SENTENCES[0], "encoding_format": "base64"})
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(raw, vecs[0], atol=1e-6)


def test_token_id_inputs_equal_their_text(server):
    from tokenizers import Tokenizer

    from models.embedding import ensure_default_embedding_model

    tok = Tokenizer.from_file(str(ensure_default_embedding_model(progress=False) / "tokenizer.json"))
    tok.no_padding()  # the file pads to 128 tokens
    ids = tok.encode(SENTENCES[0], add_special_tokens=False).ids
    by_text = embed(server.url, {"input": SENTENCES[0]}).json()["data"][0]["embedding"]
    one = embed(server.url, {"input": ids}).json()["data"][0]["embedding"]
    many = embed(server.url, {"input": [ids, ids[:3]]}).json()["data"]
    assert np.allclose(one, by_text, atol=1e-5) and np.allclose(many[0]["embedding"], by_text, atol=1e-5)
    assert len(many) == 2 and many[1]["index"] == 1


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": [""]}, 400, "input[0]"),
    ({"input": "word " * 400}, 400, "input[0]"),  # > 256 tokens: refused, not truncated
    ({"input": [[1, 2, 10 ** 9]]}, 400, "input[0]"),
    ({"input": ["ok", [1, 2]]}, 400, None),  # mixed strings and ids
    ({"input": {"text": "x"}}, 400, None),
    ({"input": "x", "encoding_format": "float16"}, 400, None),
    ({"input": "x", "dimensions": 10}, 400, "dimensions"),
    ({"input": ["x"] * 2049}, 400, "input"),
    ({"input": "x", "model": "no-such-model"}, 404, "model"),
])
def test_hostile_inputs_are_4xx_with_openai_error_bodies(server, body, status, param):
    r = embed(server.url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if param is not None:
        assert err["param"] == param


def test_embeddings_are_counted_in_stats_and_metrics(server):
    before = httpx.get(server.url + "/stats").json()["embeddings"]
    assert embed(server.url, {"input": ["a b", "c"]}).status_code == 200
    after = httpx.get(server.url + "/stats").json()["embeddings"]
    assert after["requests"] == before["requests"] + 1 and after["inputs"] == before["inputs"] + 2
    assert after["tokens"] == before["tokens"] + 4 + 3
    assert "mlx_lane:embedding_tokens_total" in httpx.get(server.url + "/metrics").text
