"""Audit ledger: one row per message field that crossed the wire.

Byte counts in metrics and reports come from this ledger, never from estimates
(DESIGN.md principle 6). Rows are buffered per round and appended to ``audit.jsonl``
when the round's checkpoint is written, so a killed run never leaves half a round behind.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedfm.core.messages import Message, MessageKind, array_bytes, meta_bytes


def dp_clients(rows: Iterable[Mapping[str, Any]]) -> set[str]:
    """Clients that sent at least one DP mechanism's output (``"privacy": "dp"``)."""
    return {str(r["client"]) for r in rows if r.get("privacy") == "dp"}


def unprotected(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fields DP clients sent that are neither a DP mechanism's output nor public.

    Args:
        rows: The rows of ``audit.jsonl``.

    Returns:
        One row per (kind, field): how many DP clients sent it and in which rounds.
    """
    rows = list(rows)
    private = dp_clients(rows)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        if r["direction"] != "up" or str(r["client"]) not in private:
            continue
        if r.get("privacy") in ("dp", "public"):
            continue
        rec = found.setdefault((r["kind"], r["field"]), {"clients": set(), "rounds": set()})
        rec["clients"].add(str(r["client"]))
        rec["rounds"].add(int(r["round"]))
    return [
        {"kind": k, "field": f, "clients": len(v["clients"]), "rounds": sorted(v["rounds"])}
        for (k, f), v in found.items()
    ]


def secagg_stages(rows: Iterable[Mapping[str, Any]]) -> list[list[Any]]:
    """Bytes per SecAgg+ stage: ``[kind, what left the clients, bytes up, bytes down]``.

    A stage is a message kind whose up rows carry a ``secagg`` label, in the order the
    stages first appear.
    """
    rows = list(rows)
    labels: dict[str, set[str]] = {}
    for r in rows:
        if r["direction"] == "up" and r.get("secagg"):
            labels.setdefault(r["kind"], set()).add(str(r["secagg"]))
    sums = {k: [0, 0] for k in labels}
    for r in rows:
        if r["kind"] in sums:
            sums[r["kind"]][0 if r["direction"] == "up" else 1] += int(r["bytes"])
    return [[k, ", ".join(sorted(labels[k])), *sums[k]] for k in labels]


#: Bytes in a GB of the communication bill (decimal, as FlowerTune's leaderboard counts).
GB = 10**9


def communication_bill(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Total GB up and down, per client and for the run, from the ledger's rows.

    FlowerTune's leaderboard ranks entries by their communication cost in GB; this is that
    column, counted from what crossed the wire (encoded sizes under a codec), not estimated.

    Args:
        rows: The rows of ``audit.jsonl``.

    Returns:
        ``gb_up``, ``gb_down``, ``gb_total`` for the run and ``per_client``: client id ->
        ``gb_up``, ``gb_down`` (GB = 10⁹ bytes).
    """
    per: dict[str, dict[str, int]] = defaultdict(lambda: {"up": 0, "down": 0})
    for r in rows:
        per[str(r["client"])][str(r["direction"])] += int(r["bytes"])
    up = sum(v["up"] for v in per.values())
    down = sum(v["down"] for v in per.values())
    return {
        "gb_up": up / GB,
        "gb_down": down / GB,
        "gb_total": (up + down) / GB,
        "per_client": {
            c: {"gb_up": v["up"] / GB, "gb_down": v["down"] / GB} for c, v in sorted(per.items())
        },
    }


class AuditLedger:
    """Records every message field with its shape, dtype and size.

    Args:
        path: ``audit.jsonl`` of the run, or None to keep rows in memory only.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.pending: list[dict] = []
        self._kinds: dict[str, MessageKind] = {}
        self._bytes: dict[tuple[int, str, str], int] = defaultdict(int)  # (round, dir, type)

    def declare(self, kinds: Mapping[str, MessageKind] | None) -> None:
        """Sets the run's message kinds.

        Each up row of a DP kind (``kind.dp``) then says whether its field is a DP output
        (``"privacy": "dp"``), a public value (``"public"``) or neither (``"none"``).
        """
        self._kinds = dict(kinds or {})

    def record(
        self,
        rnd: int,
        client: str,
        direction: str,
        msg: Message,
        coded: Mapping[str, tuple[str, int]] | None = None,
    ) -> int:
        """Adds one message's fields to the ledger.

        Args:
            rnd: Round number (0 for one-off phases before the rounds).
            client: Client id.
            direction: ``"down"`` (server to client) or ``"up"``.
            msg: The message (as decoded by its receiver).
            coded: Array field -> (codec name, bytes that travelled) for the fields sent
                through a codec (:mod:`fedfm.core.codec`): their rows count those bytes.

        Returns:
            Bytes recorded for this message.
        """
        first = len(self.pending)
        total = self._record(rnd, client, direction, msg, coded or {})
        kind = self._kinds.get(msg.kind)
        if kind is not None and kind.dp and direction == "up":
            for row in self.pending[first:]:
                row["privacy"] = kind.privacy_of(row["field"]) or "none"
        if kind is not None and kind.secagg_fields and direction == "up":
            for row in self.pending[first:]:  # what SecAgg+ lets leave a client
                row["secagg"] = kind.secagg_fields.get(row["field"], "none")
        return total

    def _record(
        self,
        rnd: int,
        client: str,
        direction: str,
        msg: Message,
        coded: Mapping[str, tuple[str, int]],
    ) -> int:
        total = 0
        for name, arrays in msg.arrays.items():
            codec, nbytes = coded.get(name, (None, array_bytes(arrays)))
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in arrays.values()})
            row = {
                "round": rnd,
                "client": client,
                "kind": msg.kind,
                "direction": direction,
                "field": name,
                "type": "arrays",
                "tensors": len(arrays),
                "numel": sum(t.numel() for t in arrays.values()),
                "dtype": ",".join(dtypes),
                "bytes": nbytes,
            }
            if len(arrays) == 1:
                row["shape"] = list(next(iter(arrays.values())).shape)
            if codec is not None:
                row["codec"] = codec
            self.pending.append(row)
            self._bytes[(rnd, direction, "arrays")] += nbytes
            total += nbytes
        for name, value in msg.meta.items():
            nbytes = meta_bytes(value)
            self.pending.append(
                {
                    "round": rnd,
                    "client": client,
                    "kind": msg.kind,
                    "direction": direction,
                    "field": name,
                    "type": "meta",
                    "bytes": nbytes,
                }
            )
            self._bytes[(rnd, direction, "meta")] += nbytes
            total += nbytes
        return total

    def round_bytes(self, rnd: int) -> dict[str, int]:
        """Bytes recorded for a round, in all and split into tensors and meta values.

        ``bytes_up``/``bytes_down`` in all, and split into tensor data (``..._arrays``) and
        JSON meta values (``..._meta``), so that uplinks of methods that send different
        metadata compare exactly.
        """
        out = {}
        for direction in ("up", "down"):
            arrays = self._bytes[(rnd, direction, "arrays")]
            meta = self._bytes[(rnd, direction, "meta")]
            out[f"bytes_{direction}"] = arrays + meta
            out[f"bytes_{direction}_arrays"] = arrays
            out[f"bytes_{direction}_meta"] = meta
        return out

    def flush(self) -> None:
        """Appends pending rows to the ledger file."""
        if self.path is not None and self.pending:
            with self.path.open("a") as f:
                for row in self.pending:
                    f.write(json.dumps(row) + "\n")
        self.pending.clear()

    def load(self, upto_round: int) -> None:
        """Reloads a ledger file on resume, dropping rows after ``upto_round``.

        Args:
            upto_round: Last round whose checkpoint was written.
        """
        if self.path is None or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a torn last line from a killed write
                continue
            if row["round"] <= upto_round:
                kept.append(row)
                self._bytes[(row["round"], row["direction"], row["type"])] += row["bytes"]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
