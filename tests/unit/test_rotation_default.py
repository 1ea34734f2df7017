"""Rotation folding on the real default model (SmolLM2-135M, llama, hidden 576, tied embeddings), in float32.

576 is not a power of two: a pure Hadamard rotation is refused with a message that says so; the block rotation
(kron(H_64, a random orthogonal 9x9)) is orthogonal too and leaves the logits unchanged to float tolerance.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from models.quant.rotation import RotationError, rotate_model

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def default_float():
    from models import ensure_default_model
    from models.quant.quantize import load_float

    return load_float(ensure_default_model(progress=False), "float32")


def test_default_model_refuses_pure_hadamard(default_float):
    model, _, config = default_float
    with pytest.raises(RotationError, match="576 is not a power of two"):
        rotate_model(model, config, kind="hadamard")


def test_block_rotation_preserves_default_model_logits(default_float):
    model, tokenizer, config = default_float
    ids = mx.array(tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))"))[None]
    before = model(ids)
    mx.eval(before)
    new_config = rotate_model(model, config, kind="block")
    after = model(ids)
    assert new_config["tie_word_embeddings"] is False
    assert mx.abs(before - after).max().item() < 1e-5 * mx.abs(before).max().item() * 10
    assert mx.array_equal(before.argmax(-1), after.argmax(-1)).item()
