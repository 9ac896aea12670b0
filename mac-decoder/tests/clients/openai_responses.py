"""Drives `k3-decode serve`'s Responses API with the official OpenAI Python SDK
(`client.responses.create`, streamed and not; run by tests/agent_clients.rs).

Usage: python3 openai_responses.py BASE_URL MODEL_ID
Checks: a function tool forced by `tool_choice`, `reasoning={"effort": "none"}`,
`max_output_tokens=128`, gives one schema-valid `function_call` item (the forced call is 81
tokens on tiny-t's 4,096-id vocabulary, which spells K3's markup text in small pieces: 32 cannot
hold it) (whole and streamed: the
event sequence response.created, response.in_progress, response.output_item.added,
response.function_call_arguments.delta/.done, response.output_item.done, response.completed, in
order, numbered); a plain streamed reply has the text events (output_item.added,
content_part.added, output_text.delta/.done, content_part.done, output_item.done) and its text
equals the deltas; `previous_response_id` continues a stored response; the sealed reasoning
(`include: ["reasoning.encrypted_content"]`) goes back as an input item. Prints one line per
check; exits non-zero on the first failure.
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")

TOOL = {
    "type": "function",
    "name": "set_mode",
    "description": "Set the mode.",
    "parameters": {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "verbose": {"type": "boolean"}},
        "required": ["mode", "verbose"],
        "additionalProperties": False,
    },
    "strict": True,
}


def check(cond, what):
    if not cond:
        print("FAIL:", what)
        sys.exit(1)


def valid_call(item):
    if item.type != "function_call" or item.name != "set_mode":
        return False
    args = json.loads(item.arguments)
    return set(args) == {"mode", "verbose"} and args["mode"] in ("fast", "slow") and isinstance(args["verbose"], bool)


forced = dict(
    model=model,
    input="Pick a mode.",
    tools=[TOOL],
    tool_choice={"type": "function", "name": "set_mode"},
    reasoning={"effort": "none"},
    max_output_tokens=128,
)

# Whole.
r = client.responses.create(**forced)
check(r.status == "completed", f"status {r.status}")
calls = [o for o in r.output if o.type == "function_call"]
check(len(calls) == 1 and valid_call(calls[0]), f"one schema-valid call: {r.output}")
check(r.usage.input_tokens > 0 and r.usage.output_tokens > 0, f"usage {r.usage}")
print("ok forced function call", calls[0].arguments)

# Streamed.
names = []
last = None
with client.responses.stream(**forced) as s:
    for ev in s:
        names.append(ev.type)
        check(ev.sequence_number == len(names) - 1, f"sequence_number {ev.sequence_number} at {len(names) - 1}")
    last = s.get_final_response()
want = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]
check([n for n in names if n in want] == want, f"forced-call events {names}")
calls = [o for o in last.output if o.type == "function_call"]
check(len(calls) == 1 and valid_call(calls[0]), f"streamed call {last.output}")
print("ok streamed forced function call", names)

# A plain streamed reply: the text events, and the text equals the deltas.
plain = dict(model=model, input=[{"role": "user", "content": "Say hello."}], reasoning={"effort": "none"}, max_output_tokens=12)
deltas = []
names = []
stream = client.responses.create(stream=True, **plain)
final = None
for ev in stream:
    names.append(ev.type)
    if ev.type == "response.output_text.delta":
        deltas.append(ev.delta)
    if ev.type in ("response.completed", "response.incomplete"):
        final = ev.response
for need in [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]:
    check(need in names, f"{need} in {names}")
check(final is not None and final.output_text == "".join(deltas), f"text {final and final.output_text!r} vs deltas {''.join(deltas)!r}")
print("ok streamed text events", len(deltas), "deltas")

# store + previous_response_id: the second turn continues the stored conversation (its prompt
# holds the first turn: more tokens cached than the new input alone).
first = client.responses.create(model=model, input="Remember the word apple.", reasoning={"effort": "none"}, max_output_tokens=8, store=True)
second = client.responses.create(model=model, input="Which word?", previous_response_id=first.id, reasoning={"effort": "none"}, max_output_tokens=8)
check(second.usage.input_tokens > first.usage.input_tokens, f"previous_response_id prompt {second.usage.input_tokens} vs {first.usage.input_tokens}")
check(second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, f"cached {second.usage.input_tokens_details.cached_tokens}")
print("ok previous_response_id", second.usage.input_tokens, "cached", second.usage.input_tokens_details.cached_tokens)
try:
    client.responses.create(model=model, input="x", previous_response_id="resp_missing", max_output_tokens=4)
    check(False, "a missing previous_response_id is refused")
except openai.NotFoundError:
    print("ok missing previous_response_id: 404")

# Sealed reasoning round trip (thinking on, store false, as Codex sends it).
think = dict(model=model, reasoning={"effort": "low"}, max_output_tokens=16, store=False, include=["reasoning.encrypted_content"])
r1 = client.responses.create(input=[{"role": "user", "content": "Think, then answer."}], **think)
rs = [o for o in r1.output if o.type == "reasoning"]
check(rs and rs[0].encrypted_content, f"a reasoning item with encrypted_content: {r1.output}")
history = [{"role": "user", "content": "Think, then answer."}] + [o.model_dump(exclude_none=True) for o in r1.output] + [{"role": "user", "content": "Again."}]
r2 = client.responses.create(input=history, **think)
check(r2.status in ("completed", "incomplete"), f"second turn {r2.status}")
check(r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens, f"the first prompt reused: {r2.usage}")
print("ok sealed reasoning round trip; cached", r2.usage.input_tokens_details.cached_tokens, "of", r2.usage.input_tokens)
print("ALL OK")
