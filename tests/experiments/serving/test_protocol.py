"""The OpenAI request checks, without a server: every bad field is a 400 naming it."""

import pytest

from core.request import SamplingParams
from experiments.serving.server.protocol import APIError, chat_prompt, completion_prompt, parse_generation

DEFAULT = SamplingParams()


class NoTemplate:
    chat_template = None

    def encode(self, text):
        return [1, 2, 3]


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 100}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": 1e-40}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"seed": 2**70}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**12]}, "stop_token_ids"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"99": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 200}}, "logit_bias"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"), ({"response_format": {"type": "json_object"}},
                                                               "response_format"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
    ({"n": 2}, "n"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "include_usage"),
])
def test_bad_fields_name_themselves(body, param):
    with pytest.raises(APIError) as e:
        parse_generation(body, (1, 2, 3), max_model_len=64, default_sampling=DEFAULT, vocab_size=50)
    assert e.value.status == 400 and e.value.param == param
    assert param in e.value.message


def test_neutral_values_of_unsupported_fields_pass_and_chat_logprobs_use_top_logprobs():
    body = {"best_of": 1, "tool_choice": "none", "tools": [], "response_format": {"type": "text"}, "suffix": "",
            "presence_penalty": 0, "logit_bias": {}}
    assert parse_generation(body, (1,), 64, DEFAULT).logprobs is None
    g = parse_generation({"logprobs": True, "top_logprobs": 3, "logit_bias": {"7": -100}, "frequency_penalty": 0.5},
                         (1,), 64, DEFAULT, vocab_size=50, chat=True)
    assert g.logprobs == 3 and g.sampling.logprobs == 3 and g.sampling.logit_bias == ((7, -100.0),)
    assert g.sampling.frequency_penalty == 0.5
    with pytest.raises(APIError) as e:
        parse_generation({"top_logprobs": 2}, (1,), 64, DEFAULT, chat=True)
    assert e.value.param == "top_logprobs"
    with pytest.raises(APIError) as e:  # a simulated model has no logits to bias
        parse_generation({"logit_bias": {"1": 5}}, (1,), 64, DEFAULT, has_logits=False)
    assert e.value.param == "logit_bias" and "backend=sim" in e.value.message
    assert parse_generation({"repetition_penalty": 1, "logprobs": None}, (1,), 64, DEFAULT, has_logits=False)


def test_text_prompts_are_bounded_and_valid_unicode():
    with pytest.raises(APIError) as e:
        completion_prompt({"prompt": "w1 \ud800 w2"}, NoTemplate(), 10)
    assert e.value.status == 400 and e.value.param == "prompt" and "surrogate" in e.value.message
    with pytest.raises(APIError) as e:
        completion_prompt({"prompt": "x" * 101}, NoTemplate(), 10, max_chars=100)
    assert e.value.status == 413 and "serve.max_prompt_chars" in e.value.message


def test_defaults_and_vllm_extensions():
    g = parse_generation({"stop": "w1", "top_k": -1, "seed": 5, "ignore_eos": True, "min_tokens": 2}, (1, 2, 3),
                         max_model_len=64, default_sampling=SamplingParams(0.5, 0.9, 0))
    assert g.max_tokens == 61  # the rest of the context, as vLLM
    assert g.sampling == SamplingParams(0.5, 0.9, 0, 5) and g.stop == ("w1",) and g.ignore_eos and g.min_tokens == 2
    assert parse_generation({"max_completion_tokens": 7}, (1,), 64, DEFAULT).max_tokens == 7


def test_prompts():
    assert completion_prompt({"prompt": [[4, 5]]}, None, 10) == (4, 5)
    assert completion_prompt({"prompt": "hi"}, NoTemplate(), 10) == (1, 2, 3)
    for body, message in (({"prompt": "hi"}, "no tokenizer"), ({"prompt": ["a", "b"]}, "batch"),
                          ({"prompt": [1, 99]}, "outside the vocabulary"), ({}, "required")):
        with pytest.raises(APIError, match=message):
            completion_prompt(body, None, 10)
    with pytest.raises(APIError, match="no chat template") as e:
        chat_prompt({"messages": [{"role": "user", "content": "hi"}]}, NoTemplate())
    assert e.value.status == 400
    with pytest.raises(APIError, match="messages"):
        chat_prompt({"messages": []}, NoTemplate())


@pytest.mark.parametrize("override,key", [("serve.max_waiting=0", "serve.max_waiting"),
                                          ("serve.drain_timeout_s=-1", "serve.drain_timeout_s"),
                                          ("serve.flush_interval_s=soon", "serve.flush_interval_s")])
def test_bad_serve_settings_fail_at_start_naming_the_key(override, key, tmp_path):
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR
    from experiments.serving.serve import build_app

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("serve", overrides=["backend=sim", override])
    with pytest.raises(ValueError, match=key):
        build_app(cfg, tmp_path)
