"""Logits controls through the whole stack: greedy output under never, always and auto equals
transformers `generate` with the equivalent processors (plain-decode grants, single steps and
verified trees alike), over gRPC and REST."""

from __future__ import annotations

import grpc
import httpx
import pytest
import torch
from transformers import LlamaForCausalLM

from tandem.v1 import generation_pb2, generation_pb2_grpc
from target_service.controls import LogitsControls
from tests.stack import Stack
from tests.test_logits_controls import hf_processors
from tests.tiny_draft import make_tiny_eagle3
from tests.tiny_models import make_tiny_llama

PROMPT = [7, 3, 21, 40, 11, 9, 7, 3]
N = 16
EOS = 2  # the character tokenizer's </s>: the gateway's end of sequence

# (gRPC fields, the same as LogitsControls, stop_token_ids)
CASES = {
    "repetition": (dict(repetition_penalty=2.5), LogitsControls(repetition_penalty=2.5), ()),
    "frequency": (dict(frequency_penalty=1.75), LogitsControls(frequency_penalty=1.75), ()),
    "presence": (dict(presence_penalty=2.0), LogitsControls(presence_penalty=2.0), ()),
    "logit_bias": (dict(logit_bias={17: -100.0, 50: 6.0}), LogitsControls(logit_bias=((17, -100.0), (50, 6.0))),
                   ()),
    "min_tokens": (dict(min_tokens=9), LogitsControls(min_tokens=9), (84, 97)),
    "min_p": (dict(min_p=0.25), LogitsControls(min_p=0.25), ()),
    "all": (dict(repetition_penalty=1.25, frequency_penalty=0.75, presence_penalty=0.375, min_p=0.0625,
                 min_tokens=5, logit_bias={50: 3.0, 8: -2.0}),
            LogitsControls(repetition_penalty=1.25, frequency_penalty=0.75, presence_penalty=0.375, min_p=0.0625,
                           min_tokens=5, logit_bias=((50, 3.0), (8, -2.0))), (84,)),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("controls-pair")
    target = make_tiny_llama(tmp / "target", "gqa", max_position_embeddings=512)
    return target, make_tiny_eagle3(tmp / "draft", target)


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory):
    """Plain decoding in grants of 8 steps, as served by default."""
    st = Stack(tmp_path_factory.mktemp("controls-stack"), pair[0], [pair[1]], "--no-profile", "--max-model-len",
               "256", "--grant-steps", "8")
    yield st
    st.stop()


@pytest.fixture(scope="module")
def hf_model(pair):
    return LlamaForCausalLM.from_pretrained(pair[0]).eval()


def hf_greedy(hf_model, controls: LogitsControls, stop_ids: tuple[int, ...]) -> list[int]:
    """generate's tokens, up to and including the first stop (EOS or a stop id), as the gateway ends."""
    stops = (EOS, *stop_ids)
    c = LogitsControls(**{**controls.__dict__, "prompt_len": len(PROMPT), "stop_ids": stops})
    with torch.no_grad():
        ids = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False, pad_token_id=0,
                                eos_token_id=list(stops), logits_processor=hf_processors(c))
    return ids[0, len(PROMPT):].tolist()


def generate(st: Stack, mode: str, stop_ids: tuple[int, ...], **fields) -> tuple[list[int], str, dict]:
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{st.grpc_port}"))
    req = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=N, temperature=0, speculation=mode,
                                         stop_token_ids=stop_ids, **fields)
    replies = list(stub.Generate(req, timeout=120))
    tokens = [t for m in replies for t in m.token_ids]
    stats = replies[-1].spec_stats
    return tokens, "".join(m.text for m in replies), {"verify_steps": stats.verify_steps}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_output_with_each_control_is_generates_in_every_mode(name, stack, hf_model):
    fields, controls, stop_ids = CASES[name]
    expected = hf_greedy(hf_model, controls, stop_ids)
    if name != "min_p":  # min_p never moves the argmax; the other controls must change this output
        assert expected != hf_greedy(hf_model, LogitsControls(), stop_ids)
    granted = stack.metrics().get("tandem_granted_steps_total", 0)
    verified = 0
    for mode in ("never", "always", "auto"):
        tokens, _, stats = generate(stack, mode, stop_ids, **fields)
        assert tokens == expected, mode
        verified += stats["verify_steps"] if mode == "always" else 0
    assert verified > 0  # the trees were verified under the controls
    assert stack.metrics()["tandem_granted_steps_total"] > granted  # and `never` decoded in grants


def test_rest_serves_the_controls_as_grpc_does(stack):
    fields, _, stop_ids = CASES["all"]
    tokens, text, _ = generate(stack, "always", stop_ids, **fields)
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "speculation": "always",
            "stop_token_ids": list(stop_ids), **{k: v for k, v in fields.items() if k != "logit_bias"},
            "logit_bias": {str(t): b for t, b in fields["logit_bias"].items()}}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text
    assert r.json()["usage"]["completion_tokens"] == len(tokens)
    spec = r.json()["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] == r.json()["spec_stats"]["verify_steps"] > 0
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    assert sum(j * c for j, c in enumerate(spec["acceptance_histogram"])) == spec["num_accepted_draft_tokens"]
