"""Drives `k3-decode serve`'s Messages API with the official Anthropic Python SDK (run by
tests/server_clients.rs).

Usage: python3 anthropic_sdk.py BASE_URL MODEL_ID
Checks, on a random-weight synthetic model: messages.create plain and streamed (the streamed text
equals the whole reply with the same seed), thinking on/off, output_config.format (json_schema), a forced tool (tool_choice
"tool") giving a schema-valid tool_use block 20 of 20 times, tool_choice "any" streamed,
count_tokens against the reply's usage, and errors as the SDK's exception types. Prints one line
per check; exits non-zero on the first failure.
"""
import concurrent.futures
import json
import sys

import anthropic

base, model = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)

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
TOOLS = [
    {"name": "set_mode", "description": "Set the mode.", "input_schema": SCHEMA},
    {"name": "other", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}},
]


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
SEED = {"seed": 1}  # this server's extension: a fixed sampler seed (the SDK has no sampling knobs)

# Plain: thinking is off unless asked for (Anthropic's default), so the reply is text.
r = client.messages.create(model=model, max_tokens=8, messages=msgs, system="Be brief.", extra_body=SEED)
check(r.type == "message" and r.role == "assistant" and r.model == model, f"plain reply {r}")
check(r.stop_reason in ("end_turn", "max_tokens"), f"plain stop_reason {r.stop_reason}")
check(all(b.type == "text" for b in r.content), f"no thinking blocks when thinking is off: {r.content}")
check(r.usage.output_tokens <= 8 and r.usage.input_tokens > 0, f"usage {r.usage}")
whole = "".join(b.text for b in r.content)
print("ok plain", repr(whole), r.stop_reason)

# count_tokens: the same prompt the reply used.
c = client.messages.count_tokens(model=model, messages=msgs, system="Be brief.")
used = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
check(c.input_tokens == used, f"count_tokens {c.input_tokens} vs usage {used}")
print("ok count_tokens", c.input_tokens)

# Streamed, same seed: the same text as the whole reply; the SDK's accumulated message agrees.
with client.messages.stream(model=model, max_tokens=8, messages=msgs, system="Be brief.", extra_body=SEED) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
check(streamed == whole, f"streamed {streamed!r} vs whole {whole!r}")
check(final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens, f"final message {final}")
events = [e.type for e in client.messages.create(model=model, max_tokens=4, messages=msgs, extra_body=SEED, stream=True)]
check(events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"], f"event order {events}")
print("ok streamed", events)

# Thinking on: the reply opens with a thinking block (K3 thinks first); off: none.
r = client.messages.create(
    model=model, max_tokens=16, messages=msgs, extra_body=SEED, thinking={"type": "enabled", "budget_tokens": 1024}
)
check(r.content and r.content[0].type == "thinking" and r.content[0].thinking, f"thinking on: {r.content}")
off = client.messages.create(model=model, max_tokens=16, messages=msgs, extra_body=SEED, thinking={"type": "disabled"})
check(all(b.type != "thinking" for b in off.content), f"thinking off: {off.content}")
on_count = client.messages.count_tokens(model=model, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
off_count = client.messages.count_tokens(model=model, messages=msgs).input_tokens
check(on_count > off_count, f"thinking on renders the effort note: {on_count} vs {off_count} tokens")
print("ok thinking on/off")

# Structured output (output_config.format): replies parse and validate.
for seed in range(5):
    r = client.messages.create(
        model=model, max_tokens=200, messages=msgs, output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
        extra_body={"seed": seed},
    )
    text = "".join(b.text for b in r.content if b.type == "text")
    check(valid(json.loads(text)) and r.stop_reason == "end_turn", f"output_config.format reply {r}")
print("ok output_config.format")

# A forced tool: 20 of 20 replies are one schema-valid tool_use block of that tool.
# (Eight at a time: the server decodes concurrent requests in one batch.)
def forced(seed):
    r = client.messages.create(
        model=model, max_tokens=200, messages=msgs, tools=TOOLS, tool_choice={"type": "tool", "name": "set_mode"},
        extra_body={"seed": seed},
    )
    uses = [b for b in r.content if b.type == "tool_use"]
    ok = len(uses) == 1 and uses[0].name == "set_mode" and valid(uses[0].input) and r.stop_reason == "tool_use"
    if not ok:
        print("  bad:", r)
    return ok


with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
    good = sum(pool.map(forced, range(20)))
print(f"forced tool: {good}/20 tool_use blocks")
check(good == 20, "forced tool")

# tool_choice any, streamed: the accumulated message holds a call to a declared tool.
with client.messages.stream(
    model=model, max_tokens=200, messages=msgs, tools=TOOLS, tool_choice={"type": "any"}, extra_body={"seed": 3}
) as stream:
    final = stream.get_final_message()
uses = [b for b in final.content if b.type == "tool_use"]
check(uses and all(u.name in ("set_mode", "other") and isinstance(u.input, dict) for u in uses), f"any, streamed: {final}")
# ("any" allows several calls: a random model may still be adding one at max_tokens.)
check(final.stop_reason in ("tool_use", "max_tokens"), f"any, streamed stop_reason {final.stop_reason}")
print("ok tool_choice any streamed")

# The round trip: the tool_use turn and a tool_result go back in.
r2 = client.messages.create(
    model=model, max_tokens=8, tools=TOOLS, extra_body=SEED,
    messages=msgs + [
        {"role": "assistant", "content": final.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "done"}]},
    ],
)
check(r2.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"after tool_result {r2}")
print("ok tool_result round trip")

# Errors arrive as the SDK's exception types with Anthropic's error body.
try:
    client.messages.create(model="claude-nonexistent", max_tokens=8, messages=msgs)
    check(False, "unknown model accepted")
except anthropic.NotFoundError as e:
    check(e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error", f"404 body {e.body}")
try:
    client.messages.create(model=model, max_tokens=8, messages=msgs, thinking={"type": "enabled", "budget_tokens": 10})
    check(False, "a budget below 1024 accepted")
except anthropic.BadRequestError as e:
    check(e.body["error"]["type"] == "invalid_request_error" and "budget_tokens" in e.body["error"]["message"], f"400 body {e.body}")
print("ok errors")

# Models, in Anthropic's shape.
listed = client.models.list()
check([m.id for m in listed.data] == [model] and listed.data[0].type == "model", f"models.list {listed}")
check(client.models.retrieve(model).id == model, "models.retrieve")
print("ok models")
print("ALL OK")
