"""A finished output's text is the tokenizer's decoding of its tokens, incomplete characters included.

Byte-level tokens split multi-byte characters; the detokenizer holds a piece
that ends inside one until the next token. These check that the last piece is
flushed when the output ends (by length or end-of-sequence), through
gateway.request.Request, the one place results land.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.detokenizer import IncrementalDetokenizer
from gateway.request import Request
from gateway.types import GenerationParams, SpecStats
from tests.tiny_models import BYTE_SPECIALS, BYTE_VOCAB, save_byte_tokenizer

EOS = BYTE_SPECIALS.index("</s>")
BYTE_IDS = st.integers(len(BYTE_SPECIALS), BYTE_VOCAB - 1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def run(tokenizer, prompt: list[int], output: list[int], chunk: int, stop: tuple[str, ...] = ()
        ) -> tuple[str, str | None]:
    """Commit `output` `chunk` tokens at a time; returns (the text emitted, the finish reason)."""
    r = Request(request_id="r", prompt=prompt, params=GenerationParams(max_tokens=len(output), stop=stop),
                sink=lambda _d: None, eos_ids=frozenset({EOS}), tokenizer=tokenizer, max_model_len=4096)
    text = []
    for i in range(0, len(output), chunk):
        new = output[i:i + chunk]
        delta = r.commit(new, [0.0] * len(new), [], len(prompt) + i, SpecStats())
        text.append(delta.text)
        if delta.finish_reason:
            return "".join(text), delta.finish_reason
    return "".join(text), None


def test_a_trailing_incomplete_character_is_emitted_as_the_tokenizer_decodes_it(tokenizer):
    euro = tokenizer.encode("a€")  # 'a' then the three bytes of U+20AC
    assert len(euro) == 4
    text, reason = run(tokenizer, tokenizer.encode("x = "), euro[:3], chunk=1)  # ends inside the euro sign
    assert reason == "length"
    assert text == decode(tokenizer, euro[:3]) and text.startswith("a") and text.endswith("\ufffd")


def test_a_character_split_across_steps_comes_out_whole(tokenizer):
    ids = tokenizer.encode("€ and é")
    assert run(tokenizer, tokenizer.encode("p"), ids, chunk=1) == ("€ and é", "length")


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer):
    prompt = tokenizer.encode("price: €")[:-1]  # the prompt stops one byte short of the euro sign
    output = tokenizer.encode("€")[-1:] + tokenizer.encode("ok")
    text, _ = run(tokenizer, prompt, output, chunk=1)
    assert text == decode(tokenizer, output)


def test_the_end_of_sequence_token_flushes_the_held_piece(tokenizer):
    output = tokenizer.encode("é")[:1] + [EOS]
    text, reason = run(tokenizer, tokenizer.encode("p"), output + tokenizer.encode("never"), chunk=2)
    assert reason == "stop" and text == decode(tokenizer, output) == "\ufffd"


def test_a_stop_string_completed_by_the_last_token_still_stops(tokenizer):
    output = tokenizer.encode("ab")
    text, reason = run(tokenizer, tokenizer.encode("p"), output, chunk=1, stop=("b",))
    assert (text, reason) == ("a", "stop")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(BYTE_IDS, min_size=1, max_size=8), output=st.lists(BYTE_IDS, min_size=1, max_size=24),
       chunk=st.integers(1, 5))
def test_any_byte_output_decodes_to_the_tokenizers_text(tokenizer, prompt, output, chunk):
    text, reason = run(tokenizer, prompt, output, chunk)
    assert reason == "length"
    assert text == decode(tokenizer, output)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=12), cut=st.integers(0, 3))
def test_pieces_of_valid_text_never_hold_a_replacement_character_once_complete(tokenizer, text, cut):
    """Valid UTF-8 cut short by `cut` bytes: every piece but the flushed last one is exact text."""
    ids = tokenizer.encode(text)
    ids = ids[:max(1, len(ids) - cut)]
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) + detok.flush() == decode(tokenizer, ids)
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in text


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(output=st.lists(st.integers(0, BYTE_VOCAB - 1), min_size=1, max_size=24),
       skip=st.booleans())
def test_a_tokenizer_without_a_fast_backend_gives_the_same_pieces_through_its_decode(tokenizer, output, skip):
    """The detokenizer decodes with a fast tokenizer's backend directly; a tokenizer with only
    decode() (a slow one) goes through decode(), and the pieces are the same."""

    class Slow:
        def decode(self, ids, **kwargs):
            return tokenizer.decode(ids, **kwargs)

    fast, slow = IncrementalDetokenizer(tokenizer, [], skip), IncrementalDetokenizer(Slow(), [], skip)
    assert fast._backend_decode is not None and slow._backend_decode is None
    assert [fast.push(t) for t in output] + [fast.flush()] == [slow.push(t) for t in output] + [slow.flush()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(BYTE_IDS, min_size=1, max_size=6),
       output=st.lists(st.integers(len(BYTE_SPECIALS) - 1, BYTE_VOCAB - 1), min_size=1, max_size=24),
       chunk=st.integers(2, 6), max_tokens=st.integers(1, 30), ignore_eos=st.booleans(),
       stop_id=st.sampled_from([None, EOS, len(BYTE_SPECIALS) + 65]), logprobs=st.booleans())
def test_a_steps_tokens_committed_at_once_give_what_committing_them_one_by_one_gives(
        tokenizer, prompt, output, chunk, max_tokens, ignore_eos, stop_id, logprobs):
    """A verified tree commits several tokens a step; without a stop string the tokens before the one
    that ends the output are detokenized in one decode. Whatever the step sizes, end-of-sequence and stop
    token ids, max_tokens and logprobs, the deltas add up to what one token a step gives."""
    output = [EOS if t == len(BYTE_SPECIALS) - 1 else t for t in output]  # some end-of-sequence tokens

    def commit_all(step: int) -> tuple:
        params = GenerationParams(max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=1 if logprobs else None,
                                  stop_token_ids=(stop_id,) if stop_id is not None else ())
        req = Request(request_id="r", prompt=prompt, params=params, sink=lambda _d: None,
                      eos_ids=frozenset({EOS}), tokenizer=tokenizer, max_model_len=4096)
        tokens, text, lps, reason = [], "", [], None
        for i in range(0, len(output), step):
            new = output[i:i + step]
            delta = req.commit(new, [-0.01 * (i + j) for j in range(len(new))], [], len(prompt) + i, SpecStats())
            tokens += delta.token_ids
            text += delta.text
            lps += [(lp.token_id, lp.token, lp.logprob) for lp in delta.logprobs or ()]
            if delta.finish_reason:
                reason = delta.finish_reason
                break
        return tokens, text, lps, reason, req.output

    assert commit_all(chunk) == commit_all(1)


# ---------------------------------------------------------------------------- end to end

PROMPTS = ["def f(x):", "naïve café ", "€ = ", "// 日本語\n"]


def test_served_text_is_the_decoding_of_the_served_tokens_over_grpc_and_rest(byte_stack, tokenizer):
    """A tiny random byte-level target emits broken and cut-off characters; whatever it emits, the
    text of a finished request is the tokenizer's decoding of its tokens, in every API."""
    import grpc
    import httpx

    from tandem.v1 import generation_pb2 as pb
    from tandem.v1 import generation_pb2_grpc

    texts = []
    with grpc.insecure_channel(f"127.0.0.1:{byte_stack.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for i, prompt in enumerate(PROMPTS):
            for seed in range(3):
                request = pb.GenerateRequest(prompt=prompt, max_tokens=9 + seed, ignore_eos=True, seed=seed + i,
                                             temperature=1.0, speculation="always" if seed else "never")
                out = list(stub.Generate(request, timeout=60))
                ids = [t for m in out for t in m.token_ids]
                text = "".join(m.text for m in out)
                assert out[-1].finish_reason == "length" and len(ids) == 9 + seed
                assert text == decode(tokenizer, ids), (prompt, seed, ids)
                texts.append(text)
        greedy = pb.GenerateRequest(prompt=PROMPTS[0], max_tokens=11, ignore_eos=True, temperature=0.0)
        grpc_text = "".join(m.text for m in stub.Generate(greedy, timeout=60))
    assert any(t.endswith("\ufffd") for t in texts)  # some outputs did end inside a character
    body = {"prompt": PROMPTS[0], "max_tokens": 11, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{byte_stack.url}/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["text"] == grpc_text
    chunks = []
    with httpx.stream("POST", f"{byte_stack.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(chunks) == grpc_text
