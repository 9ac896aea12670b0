#!/usr/bin/env python3
"""A stand-in LLM server that records what coding-agent clients send (Python stdlib only).

    python3 capture_stub.py PORT OUTDIR

Every request is written to OUTDIR/NNN.json as {"method", "path", "headers", "body"} (the body
parsed as JSON when it is JSON). Replies are the smallest valid ones each API allows: the
Anthropic Messages API (JSON or SSE, text "Hello."), the OpenAI Responses API (JSON or the
streamed event sequence) and chat completions (JSON or SSE), `GET /v1/models`. The captures are
what tests/fixtures/agents/ was trimmed from (scripts/capture-agents.sh).
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OUT = sys.argv[2] if len(sys.argv) > 2 else "captures"
# With a third argument `tools`, a request whose last item is the user's asks for a tool call
# (a shell command) with past reasoning, so the client's tool-result and reasoning round trip
# is captured too.
TOOLS = len(sys.argv) > 3 and sys.argv[3] == "tools"
COUNTER = [0]
LOCK = threading.Lock()
KEEP_HEADERS = ("user-agent", "anthropic-version", "anthropic-beta", "content-type", "x-stainless-lang", "openai-beta", "originator")


def record(method, path, headers, body):
    with LOCK:
        COUNTER[0] += 1
        n = COUNTER[0]
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = body.decode("utf-8", "replace")
    entry = {"method": method, "path": path, "headers": {k.lower(): v for k, v in headers.items() if k.lower() in KEEP_HEADERS}, "body": parsed}
    with open(os.path.join(OUT, f"{n:03d}.json"), "w") as f:
        json.dump(entry, f, indent=1)
    return parsed


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("stub: " + (fmt % args) + "\n")

    def _json(self, obj, status=200):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, events):
        """events: list of (event name or None, object)."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        for name, obj in events:
            chunk = ""
            if name:
                chunk += f"event: {name}\n"
            chunk += "data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n"
            self.wfile.write(chunk.encode())
            self.wfile.flush()
        self.close_connection = True

    def do_GET(self):
        record("GET", self.path, self.headers, b"")
        if self.path.startswith("/v1/models") or self.path.startswith("/models"):
            self._json({"object": "list", "data": [{"id": "tiny-t", "object": "model", "created": 0, "owned_by": "k3", "type": "model", "display_name": "tiny-t", "created_at": "2026-01-01T00:00:00Z"}], "has_more": False, "first_id": "tiny-t", "last_id": "tiny-t"})
        else:
            self._json({"error": {"message": "no such endpoint"}}, 404)

    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n)
        body = record("POST", self.path, self.headers, raw)
        body = body if isinstance(body, dict) else {}
        path = self.path.split("?")[0]
        model = body.get("model", "tiny-t")
        if path.endswith("/messages/count_tokens"):
            return self._json({"input_tokens": 10})
        if path.endswith("/messages"):
            usage = {"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
            msg = {"id": "msg_stub", "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
            last = (body.get("messages") or [{}])[-1].get("content")
            answered = isinstance(last, list) and any(b.get("type") == "tool_result" for b in last)
            if TOOLS and not answered and body.get("tools"):
                tool = next((t["name"] for t in body["tools"] if t.get("name") == "Bash"), body["tools"][0]["name"])
                blocks = [{"type": "thinking", "thinking": "", "signature": "SIGNATURE-STUB"},
                          {"type": "tool_use", "id": "toolu_stub1", "name": tool, "input": {"command": "echo hi", "description": "Print hi"}}]
                if not body.get("stream"):
                    return self._json(dict(msg, content=blocks, stop_reason="tool_use"))
                return self._sse([
                    ("message_start", {"type": "message_start", "message": msg}),
                    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                    ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "SIGNATURE-STUB"}}),
                    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": dict(blocks[1], input={})}),
                    ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": json.dumps(blocks[1]["input"])}}),
                    ("content_block_stop", {"type": "content_block_stop", "index": 1}),
                    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": usage}),
                    ("message_stop", {"type": "message_stop"}),
                ])
            if not body.get("stream"):
                msg = dict(msg, content=[{"type": "text", "text": "Hello."}], stop_reason="end_turn")
                return self._json(msg)
            return self._sse([
                ("message_start", {"type": "message_start", "message": msg}),
                ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello."}}),
                ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": usage}),
                ("message_stop", {"type": "message_stop"}),
            ])
        if path.endswith("/responses"):
            now = int(time.time())
            item = {"id": "msg_stub", "type": "message", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]}
            usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
            resp = {"id": "resp_stub", "object": "response", "created_at": now, "status": "in_progress", "model": model, "output": [], "usage": None}
            done = dict(resp, status="completed", output=[item], usage=usage)
            inp = body.get("input")
            answered = isinstance(inp, list) and inp and inp[-1].get("type") == "function_call_output"
            if TOOLS and not answered and body.get("tools"):
                tool = next((t["name"] for t in body["tools"] if t.get("name") in ("exec_command", "shell")), "exec_command")
                reasoning = {"id": "rs_stub", "type": "reasoning", "summary": [], "encrypted_content": "ENCRYPTED-STUB"}
                call = {"id": "fc_stub", "type": "function_call", "status": "completed", "call_id": "call_stub1", "name": tool, "arguments": json.dumps({"cmd": "echo hi"})}
                done = dict(resp, status="completed", output=[reasoning, call], usage=usage)
                if not body.get("stream"):
                    return self._json(done)
                evs = [
                    {"type": "response.created", "response": resp},
                    {"type": "response.in_progress", "response": resp},
                    {"type": "response.output_item.added", "output_index": 0, "item": dict(reasoning, encrypted_content=None)},
                    {"type": "response.output_item.done", "output_index": 0, "item": reasoning},
                    {"type": "response.output_item.added", "output_index": 1, "item": dict(call, status="in_progress", arguments="")},
                    {"type": "response.function_call_arguments.delta", "output_index": 1, "item_id": "fc_stub", "delta": call["arguments"]},
                    {"type": "response.function_call_arguments.done", "output_index": 1, "item_id": "fc_stub", "arguments": call["arguments"]},
                    {"type": "response.output_item.done", "output_index": 1, "item": call},
                    {"type": "response.completed", "response": done},
                ]
                return self._sse([(e["type"], dict(e, sequence_number=i)) for i, e in enumerate(evs)])
            if not body.get("stream"):
                return self._json(done)
            part = {"type": "output_text", "text": "", "annotations": []}
            evs = [
                {"type": "response.created", "response": resp},
                {"type": "response.in_progress", "response": resp},
                {"type": "response.output_item.added", "output_index": 0, "item": dict(item, status="in_progress", content=[])},
                {"type": "response.content_part.added", "output_index": 0, "item_id": "msg_stub", "content_index": 0, "part": part},
                {"type": "response.output_text.delta", "output_index": 0, "item_id": "msg_stub", "content_index": 0, "delta": "Hello."},
                {"type": "response.output_text.done", "output_index": 0, "item_id": "msg_stub", "content_index": 0, "text": "Hello."},
                {"type": "response.content_part.done", "output_index": 0, "item_id": "msg_stub", "content_index": 0, "part": dict(part, text="Hello.")},
                {"type": "response.output_item.done", "output_index": 0, "item": item},
                {"type": "response.completed", "response": done},
            ]
            return self._sse([(e["type"], dict(e, sequence_number=i)) for i, e in enumerate(evs)])
        if path.endswith("/chat/completions"):
            now = int(time.time())
            usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
            if not body.get("stream"):
                return self._json({"id": "chatcmpl-stub", "object": "chat.completion", "created": now, "model": model,
                                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "stop"}], "usage": usage})
            base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": now, "model": model}
            return self._sse([
                (None, dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])),
                (None, dict(base, choices=[{"index": 0, "delta": {"content": "Hello."}, "finish_reason": None}])),
                (None, dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])),
                (None, dict(base, choices=[], usage=usage)),
                (None, "[DONE]"),
            ])
        self._json({"error": {"message": "no such endpoint"}}, 404)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    srv = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print(f"stub listening on 127.0.0.1:{sys.argv[1]}, writing {OUT}", flush=True)
    srv.serve_forever()
