"""Instant OpenAI-compatible HTTP stub engines for ``pdserve bench router``'s vllm-router run.

vllm-router (``--vllm-pd-disaggregation``) sits in front of two of these: :func:`stub_app`
answers instantly as a vLLM prefill (``max_tokens=1``, ``kv_transfer_params`` back) or a vLLM
decode would (one message, or one SSE event per token when streamed). Each runs in its own
process: ``python -m services.bench.http_stubs prefill|decode PORT``.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any


def stub_app(role: str) -> Callable[..., Awaitable[None]]:
    """A raw ASGI app answering like an instant vLLM prefill or decode server: ``/health``,
    ``/v1/models`` and (chat) completions with ``max_tokens`` tokens and, for a prefill,
    ``kv_transfer_params``. Raw ASGI (no framework) so the stub costs as little as possible."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if scope["method"] == "POST" and path.startswith("/v1/"):
            payload = _stub_completion(role, path, json.loads(body or b"{}"))
        elif path == "/v1/models":
            payload = {"object": "list", "data": [{"id": "stub", "object": "model"}]}
        else:
            payload = {"status": "ok"}
        events = payload.pop("_events", None)
        content_type = b"text/event-stream" if events is not None else b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", content_type)],
            }
        )
        if events is None:
            await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
            return
        for event in events:  # one SSE event per token, as a vLLM decode streams them
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def _stub_completion(role: str, path: str, request: dict[str, Any]) -> dict[str, Any]:
    count = int(request.get("max_tokens") or request.get("max_completion_tokens") or 1)
    text = "".join(f" t{i}" for i in range(count))
    chat = path.endswith("/chat/completions")
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.get("model", "stub"),
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "completion_tokens": count, "total_tokens": 8 + count},
    }
    if request.get("stream") and role == "decode":
        body["_events"] = [
            b"data: "
            + json.dumps(
                {
                    **body,
                    "choices": [
                        {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}
                        if not chat
                        else {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}
                    ],
                }
            ).encode()
            + b"\n\n"
            for i in range(count)
        ]
    if role == "prefill":
        body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0, 1],
            "remote_engine_id": "stub-prefill",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        }
    return body


def serve_stub(role: str, port: int) -> None:
    import uvicorn  # noqa: PLC0415 - only the stub subprocess needs it

    uvicorn.run(stub_app(role), host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":  # python -m services.bench.http_stubs ROLE PORT
    if len(sys.argv) == 3:
        serve_stub(sys.argv[1], int(sys.argv[2]))
    else:
        raise SystemExit("usage: python -m services.bench.http_stubs prefill|decode PORT")
