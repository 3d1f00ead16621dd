"""Beam search through the official `openai` client, as vLLM exposes it:
`use_beam_search` with `best_of` beams and the `n` best returned, `length_penalty` and
`early_stopping` in `extra_body`. The demo model has random weights: the tests check
structure, ranking, determinism, agreement with greedy and the refusals.

Run through scripts/test_openai.sh (the server fixture is test_openai.py's).
"""

import openai
import pytest

from test_openai import client, model, server  # noqa: F401  (pytest fixtures)


def beam_completion(client, model, **extra):
    n = extra.pop("n", 1)
    logprobs = extra.pop("logprobs", None)
    return client.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=8,
        n=n,
        logprobs=logprobs,
        extra_body={"use_beam_search": True, **extra},
    )


def test_beams_come_back_ranked_and_distinct(client, model):
    out = beam_completion(
        client, model, n=3, best_of=4, length_penalty=0.0, ignore_eos=True, logprobs=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    tokens = [tuple(c.logprobs.tokens) for c in out.choices]
    assert len(set(tokens)) == 3, texts
    assert all(c.finish_reason == "length" for c in out.choices)
    # length_penalty 0: beams rank by their summed logprob.
    sums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert sums == sorted(sums, reverse=True), sums
    assert out.usage.completion_tokens == sum(len(t) for t in tokens)
    again = beam_completion(
        client, model, n=3, best_of=4, length_penalty=0.0, ignore_eos=True, logprobs=0
    )
    assert [c.text for c in again.choices] == texts, "beam search is deterministic"


def test_one_beam_is_greedy(client, model):
    greedy = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    beam = beam_completion(client, model, best_of=1)
    assert beam.choices[0].text == greedy.choices[0].text
    assert beam.choices[0].finish_reason == greedy.choices[0].finish_reason


def test_chat_returns_n_beams(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "early_stopping": True},
    )
    assert len(out.choices) == 2
    assert all(c.message.role == "assistant" for c in out.choices)
    assert out.choices[0].message.content != out.choices[1].message.content


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "temperature": 0.7}, "temperature"),
        ({"best_of": 2, "top_p": 0.5}, "top_p"),
        ({"best_of": 0}, "best_of"),
        ({"best_of": 2, "stream": True}, "stream"),
        ({"best_of": 2, "length_penalty": "long"}, "length_penalty"),
    ],
)
def test_impossible_beam_searches_are_refused_naming_the_field(client, model, extra, param):
    n = extra.pop("n", 1)
    stream = extra.pop("stream", False)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=model,
            prompt="Hi",
            max_tokens=4,
            n=n,
            stream=stream,
            extra_body={"use_beam_search": True, **extra},
        )
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


def test_more_beams_than_running_sequences_are_refused(client, model):
    # The fixture's server runs 64 sequences at once (--max-num-seqs); each beam is one.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=model,
            prompt="Hi",
            max_tokens=4,
            extra_body={"use_beam_search": True, "best_of": 128},
        )
    assert "--max-num-seqs" in err.value.body["message"], err.value.body
