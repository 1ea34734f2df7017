"""/v1/completions' ``prompt``: every form OpenAI's API takes, each validated to what pydantic's smart union over
``str | list[str] | list[int]`` gave before token ids were tried first (server.http.chat.schemas.Prompt), and one
error that says what is accepted."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.http.chat.schemas import CompletionRequest
from server.http.wire import validation_message


@pytest.mark.parametrize("prompt,expected", [
    ("hi", "hi"),
    (["hi"], "hi"),  # a list of one text is that text
    ([1, 2, 3], [1, 2, 3]),
    ([1.0, 2], [1, 2]),  # ints written as floats: lax list[int], as before
    ([1, "2"], [1, 2]),
    ([True, 2], [1, 2]),
])
def test_each_form_of_prompt(prompt, expected):
    got = CompletionRequest.model_validate({"prompt": prompt}).prompt
    assert got == expected and type(got) is type(expected)
    if isinstance(got, list):
        assert all(type(t) is int for t in got)


def test_a_long_token_id_prompt_stays_a_list_of_ints():
    ids = list(range(3, 32771))
    got = CompletionRequest.model_validate({"prompt": ids}).prompt
    assert got == ids and all(type(t) is int for t in got)


@pytest.mark.parametrize("prompt", [5, [[1, 2]], {"a": 1}, None, [1, None], ["a", 3], [1.5]])
def test_a_prompt_of_no_accepted_form_says_which_forms_are(prompt):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": prompt})
    message, param = validation_message(exc.value.errors())
    assert param == "prompt" and "a list of token ids" in message and "a string" in message


@pytest.mark.parametrize("prompt", ["", [], ["a", "b"]])
def test_empty_or_several_prompts_are_refused(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": prompt})
