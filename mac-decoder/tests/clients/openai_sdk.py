"""Drives `k3-decode serve` with the official OpenAI Python SDK (run by tests/server_clients.rs).

Usage: python3 openai_sdk.py BASE_URL MODEL_ID
Checks, on a random-weight synthetic model: plain and streamed chat, constrained decoding
(json_schema 20/20 valid, a forced named tool 20/20, json_object replies are objects,
tool_choice "required"), tool calls dropped under tool_choice "none", `n` > 1 (streamed and
not). Prints one line per check;
exits non-zero on the first failure.
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
NO_THINK = {"reasoning_effort": "none"}

SCHEMA = {
    "type": "object",
    "properties": {
        "mode": {"type": "string", "enum": ["fast", "slow", "auto"]},
        "verbose": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
    },
    "required": ["mode", "verbose", "level"],
    "additionalProperties": False,
}


def valid(obj):
    return (
        isinstance(obj, dict)
        and set(obj) == {"mode", "verbose", "level"}
        and obj["mode"] in ("fast", "slow", "auto")
        and isinstance(obj["verbose"], bool)
        and obj["level"] in ("low", "high")
    )


def check(cond, what):
    if not cond:
        print("FAIL:", what)
        sys.exit(1)


msgs = [{"role": "user", "content": "Pick a mode."}]

# Plain chat (thinking on by default: a short reply may be all reasoning).
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, seed=1)
check(r.choices[0].finish_reason in ("length", "stop"), f"plain chat finish {r.choices[0].finish_reason}")
check(r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop", "usage")
print("ok plain chat")

# json_schema (strict): 20 of 20 parse and validate, streamed and not.
good = 0
for seed in range(20):
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=200, seed=seed, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "strict": True, "schema": SCHEMA}},
    )
    c = r.choices[0]
    try:
        good += valid(json.loads(c.message.content)) and c.finish_reason == "stop"
    except (TypeError, ValueError):
        print("  invalid:", repr(c.message.content), c.finish_reason)
print(f"json_schema: {good}/20 valid")
check(good == 20, "json_schema replies")

text = ""
for chunk in client.chat.completions.create(
    model=model, messages=msgs, max_tokens=200, seed=99, stream=True, extra_body=NO_THINK,
    response_format={"type": "json_schema", "json_schema": {"name": "pick", "strict": True, "schema": SCHEMA}},
):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
check(valid(json.loads(text)), f"streamed json_schema reply {text!r}")
print("ok json_schema streamed")

# json_object: always an object.
for seed in range(5):
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=60, seed=seed, extra_body=NO_THINK, response_format={"type": "json_object"},
    )
    c = r.choices[0]
    check(c.message.content is not None and c.message.content.startswith("{"), f"json_object reply {c.message.content!r}")
    if c.finish_reason == "stop":
        check(isinstance(json.loads(c.message.content), dict), "json_object parses")
print("ok json_object")

# A forced named tool: 20 of 20 calls to it with schema-valid arguments.
tools = [
    {"type": "function", "function": {"name": "set_mode", "description": "Set the mode.", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
]
good = 0
for seed in range(20):
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=200, seed=seed, extra_body=NO_THINK, tools=tools,
        tool_choice={"type": "function", "function": {"name": "set_mode"}},
    )
    c = r.choices[0]
    calls = c.message.tool_calls or []
    ok = (
        len(calls) == 1
        and calls[0].function.name == "set_mode"
        and valid(json.loads(calls[0].function.arguments))
        and c.finish_reason in ("stop", "tool_calls")
    )
    if not ok:
        print("  bad:", c)
    good += ok
print(f"named tool: {good}/20 calls")
check(good == 20, "forced named tool")

# tool_choice "required": at least one complete call to a declared tool.
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=200, seed=5, extra_body=NO_THINK, tools=tools, tool_choice="required")
calls = r.choices[0].message.tool_calls or []
check(len(calls) >= 1 and all(t.function.name in ("set_mode", "other") for t in calls), f"required: {r.choices[0]}")
print("ok tool_choice required")

# tool_choice "none" never returns calls.
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=30, seed=5, extra_body=NO_THINK, tools=tools, tool_choice="none")
check(not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls", "tool_choice none")
print("ok tool_choice none")

# Streamed plain chat ends with a finish reason and usage.
finish, usage = None, None
for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=6, seed=3, stream=True, stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
    if chunk.usage:
        usage = chunk.usage
check(finish is not None and usage is not None and usage.completion_tokens <= 6, "streamed chat")
print("ok streamed chat")

# n > 1: one prefill, a choice per sampler seed; usage sums the choices' tokens.
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, seed=7, n=3, extra_body=NO_THINK)
check([c.index for c in r.choices] == [0, 1, 2], f"n=3 choices {r.choices}")
texts = [c.message.content for c in r.choices]
check(len(set(texts)) > 1, f"n=3: the choices differ (own seeds): {texts}")
if all(c.finish_reason == "length" for c in r.choices):
    check(r.usage.completion_tokens == 36, f"n=3 usage sums the choices: {r.usage}")
else:
    check(3 <= r.usage.completion_tokens <= 36, f"n=3 usage {r.usage}")
one = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, seed=7, extra_body=NO_THINK)
check(one.choices[0].message.content == texts[0], "choice 0 of n=3 equals the n=1 reply with the same seed")
got, finishes, usage = {}, {}, None
for chunk in client.chat.completions.create(
    model=model, messages=msgs, max_tokens=12, seed=7, n=2, stream=True, stream_options={"include_usage": True}, extra_body=NO_THINK,
):
    for c in chunk.choices:
        got[c.index] = got.get(c.index, "") + (c.delta.content or "")
        if c.finish_reason:
            finishes[c.index] = c.finish_reason
    if chunk.usage:
        usage = chunk.usage
check(got == {0: texts[0], 1: texts[1]}, f"streamed n=2 {got} vs {texts[:2]}")
check(set(finishes) == {0, 1} and usage is not None and usage.prompt_tokens == r.usage.prompt_tokens, "streamed n=2 finish and usage")
c = client.completions.create(model=model, prompt="Hello", max_tokens=5, n=2, seed=3)
check([x.index for x in c.choices] == [0, 1] and 2 <= c.usage.completion_tokens <= 10, f"completions n=2 {c}")
print("ok n > 1")
print("ALL OK")
