"""Summaries of client replies that algorithms report as metrics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fedfm.core.messages import Message
from fedfm.errors import MessageError


def meta_number(reply: Message, key: str) -> float:
    """A numeric meta field of a reply as a float.

    Raises:
        MessageError: The field is missing or not a number.
    """
    value = reply.meta.get(key)
    if not isinstance(value, int | float):
        raise MessageError(f"reply '{reply.kind}': meta field '{key}' is not a number ({value!r})")
    return float(value)


def weighted_mean_metric(replies: Mapping[str, Message] | Iterable[Message], key: str) -> float:
    """Example-weighted mean of a numeric meta field: Σ_k n_k·x_k / Σ_k n_k.

    Args:
        replies: Client id -> reply, or the replies alone; each carries ``num_examples``
            and ``key`` in its meta fields.
        key: The meta field to average.

    Returns:
        The mean, weighted by each reply's ``num_examples``.
    """
    rs = list(replies.values()) if isinstance(replies, Mapping) else list(replies)
    n = sum(meta_number(r, "num_examples") for r in rs)
    return sum(meta_number(r, key) * meta_number(r, "num_examples") for r in rs) / n


class MetricMean:
    """Running example-weighted mean of numeric meta fields, fed one reply at a time.

    The streaming counterpart of :func:`weighted_mean_metric`: summing in the order the
    replies come gives the same number as the function over the same replies in that order.

    Args:
        keys: The meta fields to average.
    """

    def __init__(self, *keys: str) -> None:
        self.keys = keys
        self.n = 0.0
        self.sums = dict.fromkeys(keys, 0.0)
        self.count = 0

    def add(self, reply: Message) -> None:
        """Adds one reply's fields, weighted by its ``num_examples``."""
        n = meta_number(reply, "num_examples")
        for key in self.keys:
            self.sums[key] += meta_number(reply, key) * n
        self.n += n
        self.count += 1

    def mean(self, key: str) -> float:
        """The weighted mean of ``key`` over the replies added so far."""
        return self.sums[key] / self.n


def summarise_client_metrics(
    per_client: Mapping[str, Mapping[str, float]], prefix: str
) -> dict[str, float]:
    """Mean and worst client of each metric (worst = min, or max for losses and errors).

    Args:
        per_client: Client id -> metric name -> value.
        prefix: Prefix of the output keys.

    Returns:
        ``{prefix + name: mean, prefix + name + "/worst": worst}`` for every metric name.
    """
    out: dict[str, float] = {}
    names = sorted({k for m in per_client.values() for k in m})
    for name in names:
        vals = [m[name] for m in per_client.values() if name in m]
        lower_better = name.rsplit("/", 1)[-1] in ("loss", "rmse")
        worst = max(vals) if lower_better else min(vals)
        out[f"{prefix}{name}"] = sum(vals) / len(vals)
        out[f"{prefix}{name}/worst"] = worst
    return out


def summarise_by_prefix(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Mean and worst client of ``prefix/metric`` values, prefix by prefix.

    Each prefix group goes through :func:`summarise_client_metrics` with the prefix stripped,
    so that the worst ``local/rmse`` or ``test/loss`` is the largest, not the smallest.

    Args:
        per_client: Client id -> ``prefix/metric`` -> value.

    Returns:
        ``{prefix/metric: mean, prefix/metric/worst: worst}``.
    """
    groups: dict[str, dict[str, dict[str, float]]] = {}
    for cid, metrics in per_client.items():
        for key, v in metrics.items():
            prefix, _, name = key.rpartition("/")
            groups.setdefault(prefix, {}).setdefault(cid, {})[name] = v
    out: dict[str, float] = {}
    for prefix, per in groups.items():
        out.update(summarise_client_metrics(per, f"{prefix}/" if prefix else ""))
    return out
