"""POST /tokenize and /detokenize (vLLM's shapes): equal to the tokenizer's own encode, chat
template and decode; bad input is a 400 naming the field. In-process on the tiny random Llama
with SmolLM2's tokenizer from test_request_fields.py."""

from __future__ import annotations

from tests.server.test_request_fields import assert_refused, chat_model, post, serve  # noqa: F401 (a fixture)

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


def test_tokenize_a_prompt_and_detokenize_it_back(chat_model):
    tokenizer = chat_model.tokenizer

    async def body(app):
        status, answer = await post(app, "/tokenize", {"prompt": "Hello, world!"})
        expected = tokenizer.encode("Hello, world!", add_special_tokens=True)
        assert status == 200 and answer == {"tokens": expected, "count": len(expected), "max_model_len": 128}, answer
        status, plain = await post(app, "/tokenize", {"model": "SmolLM2-135M-Instruct", "prompt": "Hello, world!",
                                                      "add_special_tokens": False})
        assert status == 200 and plain["tokens"] == tokenizer.encode("Hello, world!", add_special_tokens=False)
        status, answer = await post(app, "/detokenize", {"tokens": plain["tokens"]})
        assert (status, answer) == (200, {"prompt": "Hello, world!"})

    serve(chat_model, body)


def template_ids(tokenizer, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenize_messages_through_the_chat_template(chat_model):
    tokenizer = chat_model.tokenizer

    async def body(app):
        for add_generation_prompt in (False, True):
            status, answer = await post(app, "/tokenize", {"messages": MESSAGES,
                                                           "add_generation_prompt": add_generation_prompt})
            expected = template_ids(tokenizer, add_generation_prompt)
            assert status == 200 and answer["tokens"] == expected and answer["count"] == len(expected), answer
        status, chat = await post(app, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
        assert status == 200 and chat["usage"]["prompt_tokens"] == answer["count"], chat  # what a chat prompt costs

    serve(chat_model, body)


def test_bad_bodies_are_a_400_naming_the_field(chat_model):
    async def body(app):
        status, answer = await post(app, "/tokenize", {"prompt": "Hi", "add_generation_prompt": True})
        assert_refused("prompt body", status, answer, "add_generation_prompt")
        status, answer = await post(app, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True})
        assert_refused("chat body", status, answer, "add_special_tokens")
        status, answer = await post(app, "/tokenize", {"messages": [{**MESSAGES[1], "audio": {"id": "a"}}]})
        assert_refused("message field", status, answer, "messages.0.audio")
        status, answer = await post(app, "/detokenize", {"tokens": [1], "skip_special_tokens": True})
        assert_refused("detokenize body", status, answer, "skip_special_tokens")
        for path, sent, param, code in [
            ("/tokenize", {}, "prompt", "invalid_value"),
            ("/tokenize", {"prompt": 5}, "prompt", "invalid_value"),
            ("/tokenize", {"messages": []}, "messages", "invalid_value"),
            ("/tokenize", {"prompt": "Hi", "model": "gpt-4"}, "model", "model_not_found"),
            ("/detokenize", {"tokens": [1, 10**9]}, "tokens", "invalid_value"),
            ("/detokenize", {"tokens": "abc"}, "tokens", "invalid_value"),
            ("/detokenize", [1, 2], None, "invalid_value"),
        ]:
            status, answer = await post(app, path, sent)
            assert status == 400, (sent, answer)
            assert (answer["error"]["param"], answer["error"]["code"]) == (param, code), (sent, answer)
        status, answer = await post(app, "/tokenize", b'{"prompt": ')
        assert status == 400 and answer["error"]["code"] == "invalid_json", answer

    serve(chat_model, body)
