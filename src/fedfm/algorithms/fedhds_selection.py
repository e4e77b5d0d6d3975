"""FedHDS's selection maths: clustering, the six selection rules and the four coreset rules.

Paper: Zhen Qin, Zhaomin Wu, Bingsheng He, Shuiguang Deng, "Federated Data-Efficient Instruction
Tuning for Large Language Models", ACL 2025 Findings, arXiv:2410.10926
(:mod:`fedfm.algorithms.fedhds` runs the exchanges and lists the choices of ours).

Every function here takes numbers in and gives a decision out; none sees a server, a client or
a federation:

* the clustering (:func:`embed_2d`, :func:`cluster`, :func:`inter_client_select`) and the
  release under DP (:func:`privatise`, :func:`release_sensitivity`);
* a selection rule (:data:`SELECTIONS`, ``algo.selection``) turns what the ``select`` exchange
  returned (:class:`Received`: row counts, cluster ids, 2-D centroids or points per client)
  into a :class:`Choice`: which clients train, on what (a coreset rule and its picks), the
  rows of the selection log and the round's metrics. :attr:`Selection.send` says what the
  exchange asks the clients for (or that there is none, or that the server reads the data);
* a coreset rule (:data:`CORESETS`, the ``plan`` field of the ``train`` message) turns the
  server's picks into the positions of the client's rows it trains on (:class:`CoresetRequest`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfm.registry import Registry

# ----------------------------------------------------------------------------- clustering


@dataclass
class Clusters:
    """HDBSCAN's clusters of 2-D points and the member nearest each centre.

    Attributes:
        labels: ``(n,)`` cluster of each point, ``-1`` for noise.
        centres: ``(k, 2)`` the weighted centroid of each cluster ``0..k-1``.
        nearest: ``(k,)`` index of the member point nearest each centre.
    """

    labels: np.ndarray
    centres: np.ndarray
    nearest: np.ndarray

    @property
    def k(self) -> int:
        """Number of clusters."""
        return len(self.centres)


def embed_2d(x: np.ndarray, seed: int, perplexity: float = 30.0) -> np.ndarray:
    """t-SNE of ``(n, d)`` rows to ``(n, 2)``, perplexity ``min(perplexity, n − 1)``, seeded.

    Raises:
        ValueError: Fewer than two rows (t-SNE needs a neighbour).
    """
    from sklearn.manifold import TSNE

    if len(x) < 2:
        raise ValueError(f"t-SNE needs at least 2 samples, got {len(x)}")
    tsne = TSNE(n_components=2, perplexity=min(perplexity, len(x) - 1), random_state=seed % 2**32)
    return np.asarray(tsne.fit_transform(x), dtype=np.float64)


def cluster(points: np.ndarray, min_cluster_size: int, min_samples: int | None = None) -> Clusters:
    """HDBSCAN over ``(n, 2)`` points as the ``hdbscan`` package clusters them.

    Args:
        points: ``(n, 2)`` points; fewer than two form no cluster.
        min_cluster_size: HDBSCAN's minimum cluster size.
        min_samples: Neighbours that make a point's core distance, the point itself not
            counted (the ``hdbscan`` package's count); None: ``min_cluster_size``, the
            package's default. Capped at ``n − 1`` as the package caps it.
    """
    from sklearn.cluster import HDBSCAN

    n = len(points)
    if n < 2:
        return Clusters(np.full(n, -1), np.zeros((0, 2)), np.zeros(0, dtype=int))
    neighbours = max(1, min(n - 1, min_cluster_size if min_samples is None else min_samples))
    hdb = HDBSCAN(
        min_cluster_size=min_cluster_size,
        min_samples=neighbours + 1,  # sklearn counts the point itself among its neighbours
        store_centers="centroid",
        copy=True,
    )
    labels = hdb.fit_predict(points)
    centres = np.asarray(getattr(hdb, "centroids_", np.zeros((0, 2))), dtype=np.float64)
    nearest = np.zeros(len(centres), dtype=int)
    for g, centre in enumerate(centres):
        members = np.flatnonzero(labels == g)
        nearest[g] = members[np.argmin(np.linalg.norm(points[members] - centre, axis=1))]
    return Clusters(labels, centres.reshape(-1, 2), nearest)


def inter_client_select(
    centroids: np.ndarray, min_cluster_size: int = 2, min_samples: int | None = None
) -> tuple[list[int], np.ndarray]:
    """The server's step: the received centroid nearest each global cluster's centre.

    Args:
        centroids: ``(m, 2)`` every client centroid of the round.
        min_cluster_size: HDBSCAN's minimum global cluster size (paper: 2).
        min_samples: HDBSCAN's neighbours as :func:`cluster` counts them.

    Returns:
        Indices into ``centroids`` of the selected ones (one per global cluster, noise never)
        and the global cluster of every centroid (``-1``: noise).
    """
    found = cluster(centroids, min_cluster_size, min_samples)
    return [int(i) for i in found.nearest], found.labels


def privatise(
    points: np.ndarray, sigma: float, rng: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    """``tanh(points / scale) + N(0, sigma²)`` per coordinate (``sigma = 0``: tanh only)."""
    squashed = np.tanh(points / scale)
    return squashed + sigma * rng.standard_normal(points.shape) if sigma > 0 else squashed


def release_sensitivity(k: int) -> float:
    """L2 sensitivity of releasing ``k`` 2-D points after ``tanh``.

    Each coordinate lies in ``[-1, 1]``, so the release lies in ``[-1, 1]^{2k}``, whose
    diameter is ``2·sqrt(2k)``.
    """
    return 2.0 * math.sqrt(2.0 * k)


# ----------------------------------------------------------------------------- selection rules


@dataclass(frozen=True)
class ClusterSettings:
    """HDBSCAN's settings of both levels (``algo.min_cluster_size`` and the others)."""

    min_cluster_size: int
    min_samples: int | None
    server_min_cluster_size: int
    server_min_samples: int | None


@dataclass
class Received:
    """What the ``select`` exchange returned, checked (or what the server read itself).

    Attributes:
        asked: The round's sampled clients, in order.
        pool: Client id -> its usable rows, for clients that said (dropped replies included).
        use_all: Clients too small to cluster (they train on every row).
        clusters: Client id -> its cluster ids (``send: centroids`` or ``ids``).
        coords: Client id -> ``(k, 2)`` centroids (``centroids``) or every row's point
            (``points``, ``server``).
    """

    asked: list[str]
    pool: dict[str, int] = field(default_factory=dict)
    use_all: list[str] = field(default_factory=list)
    clusters: dict[str, list[int]] = field(default_factory=dict)
    coords: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Choice:
    """A selection rule's decision.

    Attributes:
        train: Client id -> ``(coreset rule, picks)`` of its ``train`` message (see
            :data:`CORESETS`); clients not named are not asked to train.
        log: Rows for the selection log.
        metrics: Extra metrics of the round.
    """

    train: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


SelectionRule = Callable[[Received, ClusterSettings], Choice]


@dataclass(frozen=True)
class Selection:
    """A selection of ``algo.selection``.

    Attributes:
        send: What the ``select`` exchange asks for: ``centroids``, ``ids`` or ``points``;
            ``None``: no exchange; ``server``: none either, the server reads the sampled
            clients' data (NOT PRIVATE) and gives the rule every row's 2-D point.
        rule: What it decides from what was received.
    """

    send: str | None
    rule: SelectionRule


SELECTIONS: Registry[Selection] = Registry("selection", "algo.selection")


def _stacked(received: Received) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """Every received coordinate in one array, and (client, index) of each row."""
    owners = [(cid, i) for cid, xy in received.coords.items() for i in range(len(xy))]
    rows = list(received.coords.values())
    return (np.concatenate(rows) if rows else np.zeros((0, 2))), owners


def hierarchical(received: Received, cfg: ClusterSettings) -> Choice:
    """Centroids up, HDBSCAN over them on the server, selected cluster ids down."""
    owners = [(cid, i) for cid, ids in received.clusters.items() for i in ids]
    points, _ = _stacked(received)
    chosen, labels = inter_client_select(
        points, cfg.server_min_cluster_size, cfg.server_min_samples
    )
    picked: dict[str, list[int]] = {cid: [] for cid in received.clusters}
    for i in chosen:
        cid, cluster_id = owners[i]
        picked[cid].append(cluster_id)
    out = Choice()
    for cid, ids in received.clusters.items():
        if picked[cid]:
            out.train[cid] = ("clusters", sorted(picked[cid]))
        selected = sorted(picked[cid])
        out.log.append(
            {"client": cid, "n": received.pool[cid], "clusters": ids, "selected": selected}
        )
    out.log.append(
        {
            "client": None,
            "centroids": len(points),
            "global_clusters": len(chosen),
            "noise_centroids": int((labels == -1).sum()),
        }
    )
    out.metrics = {"centroids": float(len(points)), "global_clusters": float(len(chosen))}
    return out


def single_level(received: Received, cfg: ClusterSettings) -> Choice:
    """Cluster ids up (no centroids), every client cluster selected."""
    out = Choice()
    for cid, ids in received.clusters.items():
        if ids:
            out.train[cid] = ("clusters", ids)
        out.log.append({"client": cid, "n": received.pool[cid], "clusters": ids, "selected": ids})
    out.metrics = {"centroids": float(sum(len(v[1]) for v in out.train.values()))}
    return out


def select_points(
    points: np.ndarray, owners: list[tuple[str, int]], cfg: ClusterSettings
) -> tuple[dict[str, list[int]], int]:
    """One HDBSCAN over pooled points: each client's positions nearest a global centre."""
    found = cluster(points, cfg.min_cluster_size, cfg.min_samples)
    picked: dict[str, list[int]] = {}
    for i in found.nearest:
        cid, pos = owners[int(i)]
        picked.setdefault(cid, []).append(pos)
    return {c: sorted(p) for c, p in picked.items()}, found.k


def global_select(received: Received, cfg: ClusterSettings) -> Choice:
    """All 2-D points up, one HDBSCAN over them on the server, positions down."""
    points, owners = _stacked(received)
    picked, k = select_points(points, owners, cfg)
    out = Choice(train={cid: ("positions", p) for cid, p in picked.items()})
    out.log = [
        {"client": cid, "n": n, "selected": picked.get(cid, [])}
        for cid, n in received.pool.items()
        if cid not in received.use_all
    ]
    out.log.append({"client": None, "points": len(points), "global_clusters": k})
    out.metrics = {"points": float(len(points)), "global_clusters": float(k)}
    return out


def random_rows(received: Received, cfg: ClusterSettings) -> Choice:
    """No selection exchange: every sampled client draws its own random rows."""
    return Choice(train={cid: ("random", []) for cid in received.asked})


def all_rows(received: Received, cfg: ClusterSettings) -> Choice:
    """No selection exchange: every sampled client trains on everything (FedIT)."""
    return Choice(train={cid: ("all", []) for cid in received.asked})


def centralised(received: Received, cfg: ClusterSettings) -> Choice:
    """The server's pooled 2-D points, one HDBSCAN, positions down.

    Without points (too few rows in the pool to cluster) every client trains on everything.
    """
    if not received.coords:
        return all_rows(received, cfg)
    points, owners = _stacked(received)
    picked, k = select_points(points, owners, cfg)
    out = Choice(train={cid: ("positions", p) for cid, p in picked.items()})
    out.log = [
        {"client": c, "n": received.pool[c], "selected": picked.get(c, [])} for c in received.asked
    ]
    out.log.append({"client": None, "points": len(points), "global_clusters": k})
    out.metrics = {"non_private": 1.0, "global_clusters": float(k)}
    return out


SELECTIONS.register("hierarchical", "FedHDS: intra-client clusters, then inter-client")(
    Selection("centroids", hierarchical)
)
SELECTIONS.register("single-level", "FedHDS without the inter-client step")(
    Selection("ids", single_level)
)
SELECTIONS.register("global", "GlobalSelect: every 2-D point clustered on the server")(
    Selection("points", global_select)
)
SELECTIONS.register("random", "random rows, random_budget of each client's data")(
    Selection(None, random_rows)
)
SELECTIONS.register("all", "FedIT: every sampled client trains on all its rows")(
    Selection(None, all_rows)
)
SELECTIONS.register("centralised", "Coreset-Cent: NOT PRIVATE, the server reads client data")(
    Selection("server", centralised)
)

# ----------------------------------------------------------------------------- coreset rules


@dataclass(frozen=True)
class CoresetRequest:
    """What a client's coreset rule reads.

    Attributes:
        pick: What the server named (cluster ids or row positions; empty for the others).
        n: The client's usable rows.
        representatives: This round's cluster id -> row position of its representative
            (raises ``ValueError`` when the client has no clusters of this round).
        budget: Share of the rows the ``random`` rule draws (``algo.random_budget``).
        seed: Seeds the ``random`` rule's draw.
    """

    pick: list[int]
    n: int
    representatives: Callable[[], Mapping[str, int]]
    budget: float
    seed: int


Coreset = Callable[[CoresetRequest], list[int]]
CORESETS: Registry[Coreset] = Registry("coreset plan", "train.plan")


@CORESETS.register("clusters", "the representative of each selected cluster of this round")
def _of_clusters(req: CoresetRequest) -> list[int]:
    reps = req.representatives()
    missing = [c for c in req.pick if str(c) not in reps]
    if missing:
        raise ValueError(f"clusters {missing} are not clusters of this client's round")
    return [int(reps[str(c)]) for c in req.pick]


@CORESETS.register("positions", "the rows the server named")
def _of_positions(req: CoresetRequest) -> list[int]:
    if any(not 0 <= p < req.n for p in req.pick):
        raise ValueError(f"positions {req.pick} are outside this client's {req.n} rows")
    return list(req.pick)


@CORESETS.register("random", "random_budget of the rows, at least one")
def _of_random(req: CoresetRequest) -> list[int]:
    k = max(1, round(req.budget * req.n))
    rng = np.random.default_rng(req.seed)
    return sorted(int(i) for i in rng.choice(req.n, size=min(k, req.n), replace=False))


@CORESETS.register("all", "every row (a client too small to cluster)")
def _of_all(req: CoresetRequest) -> list[int]:
    return list(range(req.n))
