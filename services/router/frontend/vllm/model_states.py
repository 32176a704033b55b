"""Several base models behind one router: one vLLM front-end state per model, chosen by the
request's ``model`` field.

vLLM's server serves one model: ``OpenAIServingModels`` takes several ``BaseModelPath``s, but
they are names of that one model (``--served-model-name a b``: one model config, tokenizer,
chat template and engine client). Each base model here has its own checkpoint, so each gets
the state vLLM's ``init_app_state`` builds for it (its ``OpenAIServingModels``, renderer,
serving classes), over its own :class:`~.engine_client.PdserveEngineClient` (its renderer,
input and output processors, and its model's pools). A router of one model is the case of
one state; nothing else differs.

vLLM's routes read their serving objects from ``request.app.state``. The app's state is a
:class:`ModelStates`: an attribute is read from the state of the request's model (selected by
:class:`ModelDispatch` for the request's lifetime), else from the app's own (the router's
``runtime``, what vLLM's ``build_app`` set). :class:`ModelDispatch` resolves the ``model``
field of a POST's JSON body through the one :class:`ServedNames` table (a base model, or an
adapter of one: its base model's state); a name nobody serves, or no name, goes to the first
model's state, whose vLLM code answers it as vLLM's server does (404 ``The model `x` does not
exist.``; no ``model``: the first model). With one model the body is not read. ``GET
/v1/models`` lists every model's cards (and adapters), in the order the models were given.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import State
from vllm.entrypoints.serve.engine.protocol import ModelList

from services.router.frontend.served_names import ServedNames

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MODEL_SCOPE_KEY = "pdserve.model"
"""The ASGI scope's key under which :class:`ModelDispatch` leaves the base model a request
went to (a served name, never the request's text: the ``model`` label of the router's
per-model metrics)."""

_SELECTED: contextvars.ContextVar[State | None] = contextvars.ContextVar(
    "pdserve_model_state", default=None
)


class ModelStates(State):
    """The router app's ``app.state``: each served base model's vLLM state, and the app's own
    (``shared``: what vLLM's ``build_app`` set, the router's ``runtime``); module docstring.
    Its own fields are set once in ``__init__`` (``object.__setattr__``, past the routing
    ``__setattr__``) and read as plain attributes."""

    served_names: ServedNames
    """The one table of served names (base models and adapters)."""
    _shared: State
    _models: dict[str, State]
    _own_names: dict[str, set[str]]

    def __init__(self, shared: State) -> None:
        super().__init__()
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_models", {})
        object.__setattr__(self, "_own_names", {})
        object.__setattr__(self, "served_names", ServedNames())

    def add(self, model: str, state: State) -> None:
        """Serve base model ``model`` (as its engines register it) with vLLM's ``state``."""
        if model in self._models:
            raise ValueError(f"base model {model!r} is served twice")
        self._models[model] = state
        self.served_names.add_base(model, model)

    def name_every_model(self) -> None:
        """Once every model is added: each model's ``OpenAIServingModels`` also lists the other
        models' base names after its own, so that vLLM's 404 for a name none serves says
        every valid one (as vLLM's server with several ``--served-model-name``s); its own
        names stay first (vLLM answers under the first), and no request of another model
        reaches it (:class:`ModelDispatch`)."""
        own = {
            name: list(state.openai_serving_models.base_model_paths)
            for name, state in self._models.items()
        }
        for name, state in self._models.items():
            others = [path for other, paths in own.items() if other != name for path in paths]
            # (in place: vLLM's registry of the model holds the same list)
            state.openai_serving_models.base_model_paths[:] = [*own[name], *others]
        self._own_names.clear()
        self._own_names.update((name, {path.name for path in paths}) for name, paths in own.items())

    def own_cards(self, name: str, cards: list[Any]) -> list[Any]:
        """What model ``name``'s ``/v1/models`` listing says of it: its base names and its
        adapters, not the other models' names (:meth:`name_every_model`)."""
        own = self._own_names.get(name, {name})
        return [card for card in cards if card.id in own or card.parent is not None]

    def clear(self) -> None:
        """Forget every model (the app's lifespan ended)."""
        self._models.clear()
        self._own_names.clear()
        object.__setattr__(self, "served_names", ServedNames())

    def models(self) -> Iterator[tuple[str, State]]:
        """Every base model served and its state, in the order added."""
        return iter(list(self._models.items()))

    def count(self) -> int:
        return len(self._models)

    def choose(self, name: str | None) -> tuple[str, State] | None:
        """The base model and state a request naming ``name`` goes to: the one serving it,
        else the first (whose vLLM code answers an unknown name); ``None`` before any."""
        served = self.served_names.resolve(name)
        if served is not None and served.model in self._models:
            return served.model, self._models[served.model]
        return next(iter(self._models.items()), None)

    def _selected(self) -> State | None:
        """The request's model's state (the first model's outside a request)."""
        state = _SELECTED.get()
        return state if state is not None else next(iter(self._models.values()), None)

    def __getattr__(self, key: str) -> Any:
        state = self._selected()
        if state is not None and hasattr(state, key):
            return getattr(state, key)
        return getattr(self._shared, key)

    def __setattr__(self, key: str, value: Any) -> None:
        """An attribute of the model's state is set there (vLLM's load tracking counts per
        model), any other on the app's own."""
        state = self._selected()
        setattr(state if state is not None and hasattr(state, key) else self._shared, key, value)

    def __delattr__(self, key: str) -> None:
        delattr(self._shared, key)


class ModelDispatch:
    """ASGI layer in front of vLLM's app: selects the state of the request's model
    (:class:`ModelStates`) for the request's lifetime and names it in the scope
    (:data:`MODEL_SCOPE_KEY`)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], states: ModelStates):
        self.app = app
        self.states = states

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.states.count() == 0:
            await self.app(scope, receive, send)
            return
        name: str | None = None
        if self.states.count() > 1 and scope.get("method") == "POST":
            receive, name = await _read_model(receive)
        chosen = self.states.choose(name)
        assert chosen is not None  # (count() > 0)
        scope[MODEL_SCOPE_KEY] = chosen[0]
        token = _SELECTED.set(chosen[1])
        try:
            await self.app(scope, receive, send)
        finally:
            _SELECTED.reset(token)


async def _read_model(receive: Receive) -> tuple[Receive, str | None]:
    """The ``model`` field of a JSON body read whole (``None``: none, or not JSON), and a
    ``receive`` that hands the app the body as it came."""
    messages: list[Message] = []
    body = bytearray()
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    read = iter(messages)

    async def replayed() -> Message:
        return next(read, None) or await receive()

    try:
        parsed = json.loads(body) if body else None
    except ValueError:  # not JSON: vLLM's own code answers it
        return replayed, None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return replayed, model if isinstance(model, str) else None


models_router = APIRouter()


@models_router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    """vLLM's ``/v1/models`` over every served base model: each model's cards (its base model
    and its adapters, as its ``OpenAIServingModels`` lists them)."""
    states: ModelStates = raw_request.app.state
    cards = []
    for name, state in states.models():
        listing = await state.openai_serving_models.show_available_models()
        cards.extend(states.own_cards(name, listing.data))
    return JSONResponse(content=ModelList(data=cards).model_dump())
