"""Counts the HTTP requests a Python process sends, for ``deploy_overhead.py``.

Imported at start-up by every Python process whose ``PYTHONPATH`` holds this folder (the
benchmark puts it there for the deployment's processes). When ``FEDFM_REQUEST_COUNT_DIR``
is set, every request an ``httpx.Client`` sends (Flower's SuperNode, ServerApp, warm
worker, SuperExec and CLI all talk HTTP through it) is counted by URL path, and the counts
are written to ``<dir>/<pid>.json`` every 0.1 s and at exit. Any other ``sitecustomize`` on
the path is imported after this one.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

_DIR = os.environ.get("FEDFM_REQUEST_COUNT_DIR")


def _install(folder: str) -> None:
    import atexit
    import json
    import threading
    import time
    from collections import Counter

    import httpx

    counts: Counter[str] = Counter()
    send = httpx.Client.send

    def counted(self: httpx.Client, request: httpx.Request, *args: Any, **kw: Any) -> Any:
        counts[request.url.path] += 1
        return send(self, request, *args, **kw)

    httpx.Client.send = counted  # type: ignore[method-assign]
    path = os.path.join(folder, f"{os.getpid()}.json")

    def dump() -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(counts), f)
        os.replace(tmp, path)

    def loop() -> None:
        while True:
            time.sleep(0.1)
            dump()

    threading.Thread(target=loop, daemon=True).start()
    atexit.register(dump)


def _next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from importlib.machinery import PathFinder

    found = PathFinder.find_spec("sitecustomize", rest)
    if found is not None and found.loader is not None:
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)


if _DIR:
    _install(_DIR)
_next_sitecustomize()
