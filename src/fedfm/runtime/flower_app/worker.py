"""A warm ClientApp worker for a SuperNode started with ``--isolation process``.

Flower's own executor (``flower-superexec``) starts a fresh ``flwr-clientapp`` process for
every message a SuperNode receives: the interpreter starts, torch and fedfm are imported and
the task is rebuilt each time (seconds per message here, and a reload of any frozen base
model). This worker takes the SuperNode's ClientApp tasks one after another in one
long-lived process instead, through the same runtime API and the same steps as
``flwr-clientapp`` (pull the task input, run the ClientApp, push the reply and the updated
context), so fedfm's per-process caches (task, algorithm, models) stay warm.

It runs only fedfm's ClientApp: a SuperNode paired with it serves fedfm runs. It leans on
Flower's runtime-API helpers of the pinned flwr version (1.42); ``isolation="subprocess"``
in :func:`fedfm.runtime.flower.deploy_client.supernode_command` is the stock fallback.

Run it as ``python -m fedfm.runtime.flower_app.worker --runtime-api-address 127.0.0.1:PORT
[--wake-port WAKE]``. With ``--wake-port`` (the same port as its SuperNode's, see
:mod:`fedfm.runtime.flower.pacing`) it asks for a task when the SuperNode says a message is
in (and every 30 s otherwise) instead of every 50 ms.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("fedfm")


def _client(
    address: str,
    insecure: bool,
    root_certificates: bytes | None,
    token: str | None,
    max_tries: int | None = None,
) -> Any:
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors: list[Any] = [
        RuntimeVersionHttpInterceptor(component_name="flwr-clientapp" if token else "SuperExec")
    ]
    if token:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    retry = make_simple_http_retry_invoker()
    if max_tries is not None:
        retry.max_tries = max_tries
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=root_certificates,
        interceptors=interceptors,
        retry_invoker=retry,
    )


def run_task(address: str, token: str, insecure: bool, root_certificates: bytes | None) -> None:
    """Runs one ClientApp task in this process (the body of ``flwr-clientapp``)."""
    from flwr.app import Error
    from flwr.app import Message as FlowerMessage
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supernode.runtime.run_clientapp import (
        pull_task_input,
        push_message,
        push_task_output,
    )

    from fedfm.runtime.flower_app import client_app

    client = _client(address, insecure, root_certificates, token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        message, context, _run, _fab = pull_task_input(client)
        reply = client_app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as e:  # reported to the server as an error reply, as flwr-clientapp does
        log.exception("ClientApp task failed")
        details = f"{type(e)}:<'{e}'>"
        if message is not None:
            reply = FlowerMessage(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                reply_to=message,
            )
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        finally:
            # The heartbeats end before the output goes: pushing it revokes the task's token,
            # and a heartbeat the SuperNode handles after that is refused, on which Flower
            # sends SIGINT to this whole process (it ends a ``flwr-clientapp`` process of one
            # task; here it would end the worker mid-run, with code 0).
            if heartbeat.is_running:
                heartbeat.stop()  # waits for a heartbeat in flight
            try:
                push_task_output(client, context, status, details)
            finally:
                client.close()


def serve(
    address: str,
    insecure: bool = True,
    root_certificates: Path | None = None,
    poll_s: float = 0.05,
    parent_pid: int | None = None,
    wake_port: int | None = None,
) -> None:
    """Takes ClientApp tasks from a SuperNode's runtime API until stopped.

    Args:
        address: The SuperNode's runtime API (``host:port``).
        insecure: Connect without TLS (the runtime API listens on 127.0.0.1).
        root_certificates: CA certificate of the runtime API when it uses TLS.
        poll_s: Sleep between two polls when there is no task (without a wake port).
        parent_pid: Exit when this process (the SuperNode) is gone.
        wake_port: UDP port on 127.0.0.1 on which the SuperNode says a message is in.
    """
    from flwr.proto.runtime_pb2 import AcquireTaskRequest

    from fedfm.runtime.flower.pacing import pinned, quick_object_pulls

    if pinned():
        quick_object_pulls()  # a task shows before its message's objects are all in
    certs = root_certificates.read_bytes() if root_certificates else None
    if parent_pid is not None:
        _exit_with(parent_pid)
    # One try per call: this loop retries itself, without the client's growing back-off,
    # so the first task is taken as soon as the SuperNode's runtime API is up.
    acquire = _client(address, insecure, certs, None, max_tries=1)
    idle, waking = _idle_wait(wake_port, poll_s)  # listening before the first ask: none lost
    log.info("fedfm worker serving %s", address)
    woken: object = None  # what the last idle wait returned (False: no wake came)
    try:
        while True:
            try:
                res = acquire.AcquireTask(
                    AcquireTaskRequest(supported_task_types=["flwr-clientapp"])
                )
            except Exception as e:  # the SuperNode may not be up yet, or restarting
                log.debug("runtime API not reachable: %s", e)
                time.sleep(0.5)
                continue
            if res.HasField("task") and res.token:
                if woken is False:
                    _no_wake(wake_port)
                run_task(address, res.token, insecure, certs)
                if not waking:
                    continue  # polling: ask again at once
            # Woken: a message that came in meanwhile has its wake waiting already.
            woken = idle()
    except KeyboardInterrupt:
        pass
    finally:
        acquire.close()


@functools.cache
def _no_wake(wake_port: int | None) -> None:
    """Says once that a task waited for the fallback ask instead of being woken."""
    log.warning(
        "a task waited for the fallback ask: no wake came on port %s; start the SuperNode"
        " with the same --wake-port (python -m fedfm.runtime.flower.supernode)",
        wake_port,
    )


def _idle_wait(wake_port: int | None, poll_s: float) -> tuple[Callable[[], object], bool]:
    """What the worker does between two asks for a task.

    And whether that is waiting for a wake (else sleeping ``poll_s``).
    """
    from fedfm.runtime.flower.pacing import WAKE_FALLBACK_S, WakeListener

    if wake_port is None:
        return functools.partial(time.sleep, poll_s), False
    try:
        listener = WakeListener(wake_port)
    except OSError as e:
        log.warning("wake port %d unusable (%s): asking every %.2f s", wake_port, e, poll_s)
        return functools.partial(time.sleep, poll_s), False
    return functools.partial(listener.wait, WAKE_FALLBACK_S), True


def _exit_with(parent_pid: int) -> None:
    """Exits this process as soon as the SuperNode it serves is gone."""

    def watch() -> None:
        while _alive(parent_pid):
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime-api-address", required=True)
    p.add_argument("--root-certificates", type=Path, default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--poll-s", type=float, default=0.05)
    p.add_argument("--wake-port", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    # Import the heavy modules while the SuperNode connects, not on the first message.
    import fedfm.runtime.flower_app  # noqa: F401

    serve(
        args.runtime_api_address,
        insecure=args.root_certificates is None,
        root_certificates=args.root_certificates,
        poll_s=args.poll_s,
        parent_pid=args.parent_pid,
        wake_port=args.wake_port,
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
