"""Errors of the engines package.

::

    EngineError                     every error raised by services.engines
    ├── ModelConfigError (ValueError)   config.json missing, unreadable or inconsistent
    │   └── UnsupportedModelError       a valid config this engine does not implement
    │                                   (architecture, rope type, activation, sliding window)
    ├── CheckpointError             weight or tokenizer files missing, a tensor missing or of the
    │                               wrong shape, an index naming a file that is not there
    ├── ShardingError (ValueError)  a PP x TP shard the model cannot be cut into (heads or MLP
    │                               width that do not divide, a layer range outside the model,
    │                               a TP > 1 shard without an all-reduce)
    ├── BatchError (ValueError)     a forward step inconsistent with the shard or its KV cache
    │                               (block table too short, block id out of range, inputs of the
    │                               wrong stage)
    ├── RequestError                request-scoped serving errors (the backend seam's contract)
    │   ├── InvalidRequest (ValueError)  bad parameters or token ids      -> INVALID_ARGUMENT
    │   │   └── LoRANotServed       a LoRA adapter on an engine without
    │   │                           LoRA slots (reference, no --enable-lora) -> INVALID_ARGUMENT
    │   ├── LoRAAdapterNotFound     no adapter in the folder named (vLLM's
    │   │                           LoRAAdapterNotFoundError message)      -> NOT_FOUND
    │   ├── DuplicateRequest        a request id already running here     -> ALREADY_EXISTS
    │   ├── UnknownKVHandle         no held KV under that handle here     -> NOT_FOUND
    │   ├── KVLeaseExpired          the handle's lease ran out            -> FAILED_PRECONDITION
    │   ├── ProducerUnavailable     the producer is gone, not READY, or of
    │   │                           another generation than the handle    -> UNAVAILABLE
    │   ├── KVTransferFailed        the pull failed (reason attached)     -> UNAVAILABLE
    │   ├── EngineOverloaded        admission refused (queue or KV full)  -> RESOURCE_EXHAUSTED
    │   ├── RequestAborted          aborted before its first token        -> CANCELLED
    │   ├── EngineStalled           no step within the caller's idle
    │   │                           bound (DecodeOnce); aborted           -> DEADLINE_EXCEEDED
    │   └── EngineDraining          the engine stopped admitting          -> UNAVAILABLE
    └── EngineFailed                a rank died or the engine cannot run  -> INTERNAL

``ModelConfigError``, ``CheckpointError`` and ``ShardingError`` are start-up errors: the worker
cannot serve this model and should exit. ``BatchError`` is raised before anything is written to
the KV cache, so the step can be failed and the engine keeps running; it still means the scheduler
built an impossible step, so it is a bug to report, not a request to retry.

``TokenizerError`` (token ids a tokenizer cannot decode, outside its vocabulary; a
``ValueError``) is :class:`services.tokenization.errors.TokenizerError`, re-exported here: the
tokenizer lives below the engines (the router uses it too), so it is no ``EngineError``. It is
request-scoped: fail that request only. A tokenizer that cannot be loaded is a
``CheckpointError`` (the reference engine wraps the tokenizer's ``TokenizerFilesError``).
"""

from services.tokenization.errors import TokenizerError


class EngineError(Exception):
    """Base of every error raised by ``services.engines``."""


class ModelConfigError(EngineError, ValueError):
    """``config.json`` is missing, unreadable, or holds values that cannot describe a model."""


class UnsupportedModelError(ModelConfigError):
    """A well-formed config of a model this engine does not implement."""


class CheckpointError(EngineError):
    """Weights or tokenizer files are missing or do not match the config."""


class ShardingError(EngineError, ValueError):
    """The model cannot be cut into the requested PP x TP shard."""


class BatchError(EngineError, ValueError):
    """A forward step that does not fit the shard or its KV cache; nothing was written."""


class RequestError(EngineError):
    """A request-scoped serving error: that request fails, the engine keeps serving."""


class InvalidRequest(RequestError, ValueError):
    """Bad sampling parameters or token ids; the message names the field."""


class LoRANotServed(InvalidRequest):
    """A LoRA adapter asked of an engine that registered no LoRA slots; the message names the
    engine."""


class LoRAAdapterNotFound(RequestError):
    """An adapter folder the engine finds no adapter in (vLLM's message)."""


class DuplicateRequest(RequestError):
    """A request id that is already running on this engine."""


class UnknownKVHandle(RequestError):
    """The producer holds no KV under this handle (never prefilled, already pulled or freed)."""


class KVLeaseExpired(RequestError):
    """The handle's lease ran out before the pull started; the producer freed the blocks."""


class ProducerUnavailable(RequestError):
    """The handle's producer engine is gone, not READY, or at another generation."""


class KVTransferFailed(RequestError):
    """A KV pull failed; ``reason`` is the data plane's label (``remote_disconnected``...)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineOverloaded(RequestError):
    """Admission refused: the queue or the KV pool is full."""


class RequestAborted(RequestError):
    """A prefill aborted before its first token: ``prefill()`` raises it (a decode stream ends
    with ``FinishReason.ABORT`` instead)."""


class EngineStalled(RequestError):
    """No step of a request came within the idle bound its caller set (the ``DecodeOnce`` RPC's
    ``idle_timeout_s``): the engine stalls without failing. The request was aborted."""


class EngineDraining(RequestError):
    """The engine is draining (shutting down) and admits no new request."""


class EngineFailed(EngineError):
    """A rank process died or the engine cannot run; the host must stop serving."""


__all__ = [
    "BatchError",
    "CheckpointError",
    "DuplicateRequest",
    "EngineDraining",
    "EngineError",
    "EngineFailed",
    "EngineOverloaded",
    "EngineStalled",
    "InvalidRequest",
    "KVLeaseExpired",
    "KVTransferFailed",
    "LoRAAdapterNotFound",
    "LoRANotServed",
    "ModelConfigError",
    "ProducerUnavailable",
    "RequestAborted",
    "RequestError",
    "ShardingError",
    "TokenizerError",
    "UnknownKVHandle",
    "UnsupportedModelError",
]
