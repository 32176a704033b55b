"""KV-cache events: what an engine's prefix cache stored and removed, on vLLM's wire format
(``vllm.distributed.kv_events``: ZMQ PUB frames ``(topic, seq, msgpack payload)`` plus a
ROUTER replay endpoint). Engines publish them; routers subscribe and index them."""
