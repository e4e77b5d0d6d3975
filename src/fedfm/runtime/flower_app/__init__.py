"""fedfm as a Flower app: the ServerApp and the ClientApp.

``server_app`` and ``client_app`` are what a Flower app's ``pyproject.toml`` names
(``fedfm.runtime.flower_app:server_app`` / ``:client_app``); they read the fedfm payload
from Flower's run config. :func:`make_server_app` and :func:`make_client_app` build the same
apps around a payload given in Python, for the in-process simulation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fedfm.runtime.flower.client import handle_hello, handle_message
from fedfm.runtime.flower.server import server_main
from fedfm.runtime.flower.wire import Payload

if TYPE_CHECKING:
    from flwr.app import Context, Message
    from flwr.serverapp import Grid


def make_server_app(
    payload: Payload | None = None, sink: dict[str, Any] | None = None
) -> ServerApp:
    """A ServerApp that runs the fedfm engine.

    Args:
        payload: The run's payload; None reads it from Flower's run config.
        sink: If given, receives ``"summary"`` (or the ``"error"`` that ended the run)
            instead of the error propagating through Flower.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        p = payload or Payload.from_context(context.run_config)
        try:
            summary = server_main(grid, p)
        except BaseException as e:
            if sink is None:
                raise
            sink["error"] = e
            return
        if sink is not None:
            sink["summary"] = summary

    return app


def make_client_app(payload: Payload | None = None) -> ClientApp:
    """A ClientApp that serves fedfm messages (``query.fedfm``, ``query.fedfm_hello``).

    Args:
        payload: The run's payload; None reads it from Flower's run config.
    """
    app = ClientApp()

    @app.query("fedfm")
    def call(message: Message, context: Context) -> Message:
        return handle_message(message, context, payload)

    @app.query("fedfm_hello")
    def hello(message: Message, context: Context) -> Message:
        return handle_hello(message, context, payload)

    return app


server_app = make_server_app()
client_app = make_client_app()
