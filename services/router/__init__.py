"""The router service: vLLM's OpenAI front end over pdserve's placement and PD execution
(docs/router.md)."""
