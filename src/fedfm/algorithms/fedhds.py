"""FedHDS and FedHDS-Turbo: hierarchical data selection for federated instruction tuning.

Paper: Zhen Qin, Zhaomin Wu, Bingsheng He, Shuiguang Deng, "Federated Data-Efficient Instruction
Tuning for Large Language Models", ACL 2025 Findings, arXiv:2410.10926.

Each round has two exchanges, selection then training:

1. ``select`` (no gradients): every sampled client represents each of its samples by the last
   token's hidden state of every layer, embedding output included, concatenated
   (``(layers + 1) · hidden`` floats, in float64), taken with the current global adapter;
   reduces them to 2-D with t-SNE (perplexity ``min(30, n − 1)``, seeded); clusters the 2-D
   points with HDBSCAN; and replies with each cluster's centroid (two floats) and its id only.
2. The server runs HDBSCAN (``min_cluster_size`` 2) over every received centroid; in each
   global cluster the client centroid nearest the cluster's centre is selected, noise
   centroids are dropped.
3. ``train``: each client with a selected cluster keeps, per selected cluster, the one sample
   nearest that cluster's centroid and trains the LoRA adapter on that coreset for the run's
   local budget (``train.epochs`` over the coreset); clients with nothing selected get no
   ``train`` message. The server averages the adapters weighted by coreset size and applies any
   server optimizer of :mod:`fedfm.core.optim`.

FedHDS-Turbo (``algo.feature_model``) takes the features from a small separate frozen model
(a text encoder of :data:`fedfm.models.encoders.ENCODERS` with per-layer features: MiniLM
through sentence-transformers, or a small causal LM) instead of the LLM: they cannot
change, so each client computes them once and keeps them in its persistent state, and the
``select`` message then carries no adapter. Differential privacy (``algo.dp_sigma > 0``): each
released coordinate is squashed by ``tanh`` and Gaussian noise of std ``dp_sigma`` is added on
the client before it leaves, drawn from the client's own secret (:mod:`fedfm.core.secret`;
``privacy.noise: seeded``: from the run seed); the server registers the mechanism in the run's
privacy ledger. Only the coordinates are protected: the row count, the number of clusters,
the timings and the trained adapter leave the client as they are, so this option is no
guarantee against the server (the audit ledger and ``report.html`` show each such field).

Baselines (``algo.selection``, the :data:`~fedfm.algorithms.fedhds_selection.SELECTIONS` registry;
their maths and the coreset rules are :mod:`fedfm.algorithms.fedhds_selection`):

* ``hierarchical``: FedHDS itself (the default).
* ``single-level``: the intra-client step only; every client cluster is selected, so clients
  reply with their cluster ids and no centroids (the paper's FedHDS‡).
* ``global``: GlobalSelect; each client sends every sample's 2-D point (its own t-SNE) and the
  server clusters all of them at once, selecting the point nearest each global cluster's
  centre: far more bytes up, as the audit ledger shows.
* ``all``: FedIT, every sampled client trains on all its rows and no selection exchange; the
  same rounds as :mod:`fedfm.algorithms.fedavg` on this task (tested), with this file's
  evaluation (:func:`rouge_all`), so a study compares every method on the same metrics.
* ``random``: each sampled client trains on ``random_budget`` of its samples drawn at random
  (at least one), no selection exchange: set the budget to FedHDS's measured data fraction
  for the same data budget.
* ``centralised``: Coreset-Cent. NOT PRIVATE, a reference only: the server reads the sampled
  clients' data itself, pools it, runs one t-SNE and HDBSCAN over the pool and keeps the sample
  nearest each cluster's centre; the selected samples are then trained on federatedly.

FedIT on all the data is :mod:`fedfm.algorithms.fedavg` on the same instruction task, or
``selection: all`` here.

Efficiency, measured in the run (metrics of every round, totals in the summary's ``finish``):
``data_fraction`` (coreset rows over the sampled clients' rows), ``train_s`` (client training
time, summed over clients), ``feature_s`` and ``cluster_s`` (client feature extraction and
t-SNE + HDBSCAN), ``select_s`` (the server's own selection step), ``client_s`` (all client
compute); bytes up and down come from the audit ledger as for every algorithm.

Artefacts: ``selection.jsonl`` (per round: each asked client's row count, clusters, selected
clusters or rows, whether it trained or used all its rows; and the server's row: centroids or
points received, global clusters, noise). Every evaluated item, with its score and Rouge-L, is
returned with the metrics and kept in the run's ``eval_items.jsonl`` (for paired comparisons
between runs and the run's report).

Libraries: scikit-learn's ``TSNE`` (Barnes-Hut, as the paper's official code uses) and
``HDBSCAN`` (``store_centers="centroid"``: the membership-probability weighted mean of a
cluster's points, the same centre as the ``hdbscan`` package's ``weighted_cluster_centroid``
that the official code calls); openTSNE is not used, so that the embedding is sklearn's, as
in the paper. The official code calls the ``hdbscan`` package with its default
``min_samples`` (= ``min_cluster_size``), which counts a point's neighbours *without* the
point; scikit-learn counts the point itself, so :func:`cluster` passes sklearn one more
(``min_samples`` here is always the package's count, capped at ``n − 1`` as the package
does). With it, sklearn's labels and centres equal the package's under its exact Prim
algorithm (tested on fixed points and on random 2-D mixtures, ``tests/test_fedhds.py``).
The package's default for 2-D points, a Boruvka spanning tree, has the same edge weights but
orders merges of equal mutual-reachability distance differently (ties are common: a core
distance often decides an edge), so some partitions differ: on 200 random 2-D mixtures of
8-60 points, 46 differed, 22 with more clusters than Prim's, 7 with fewer (``pytest -s
tests/test_fedhds.py -k prim_tree`` prints these counts). It is not
followed here: the paper specifies HDBSCAN, not a tie order, and the package (a test
dependency only) has lagged scikit-learn's API (0.8.40 fails on scikit-learn 1.9).

Choices of ours (the paper does not make them; each is a config option or stated here):
    * Features are taken over the sample as it is trained on (chat-formatted prompt and
      response, ``task.prompt`` limits), in batches (``feature_batch_size``) rather than one
      at a time (equal up to float error); FedHDS-Turbo's model reads the raw
      ``instruction``, ``input`` and ``output`` joined by newlines.
    * Pooling per layer (``feature_pool: auto``) follows the feature model: a causal LM's
      last token (the paper's text), a BERT-style encoder's mean over its non-padding tokens,
      special tokens included (its last token is the ``[SEP]`` that closes every text). The
      official code averages every token by default (``feature_token="avg"``, one sample a
      batch, so no padding) for either kind; its paper's Turbo model is GPT-2, which is not
      among the offline assets here, so fedfm's Turbo preset uses all-MiniLM-L6-v2.
    * t-SNE is seeded per (run seed, round, client) with ``init="pca"`` (sklearn's default);
      ``perplexity`` caps the paper's ``min(30, n − 1)`` (30).
    * A client with fewer samples than ``max(2, min_cluster_size)`` cannot form a cluster:
      it trains on all its samples (logged, ``use_all`` in the selection log).
    * The representative sample of a cluster is the cluster member nearest its centroid in
      the 2-D embedding (the true centroid, never the noisy one that was released).
    * DP: ``tanh`` is applied to each coordinate (divided by ``dp_scale`` first, default 1 as
      in the official code, where t-SNE coordinates of tens saturate to ±1); after ``tanh``
      a release of k centroids lies in ``[-1, 1]^{2k}``, so its L2 sensitivity is taken as
      that box's diameter ``2·sqrt(2k)`` and registered per client and round. Only centroid
      coordinates are protected: the number of clusters and their ids are released as they are.
    * Centroids and points travel as float32 (8 bytes per 2-D point); features, t-SNE and
      HDBSCAN run in float64.
    * The ``train`` message carries the global adapter again (the ``select`` message already
      did), so the audit counts it twice per trained client; bytes are never hidden.
    * Aggregation weights are coreset sizes; ``aggregator`` may replace the weighted mean by a
      robust rule (:mod:`fedfm.core.robust`) before the server optimizer.
    * A round in which no sample is selected leaves the adapter unchanged and goes on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import Tensor
from typing_extensions import override

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf
from fedfm.algorithms.fedhds_selection import (
    CORESETS,
    SELECTIONS,
    ClusterSettings,
    CoresetRequest,
    Received,
    cluster,
    embed_2d,
    privatise,
    release_sensitivity,
)
from fedfm.config import RunConfig
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.groups import get_group, join_groups
from fedfm.core.messages import Message, MessageKind, MetaSpec, MetaValue
from fedfm.core.optim import ServerOptConfig, ServerOptimizer
from fedfm.core.replies import MetricMean, meta_number
from fedfm.core.robust import AggregatorConfig
from fedfm.core.secret import noise_seed
from fedfm.core.seeding import derive_seed
from fedfm.core.train import client_config, local_train, num_steps
from fedfm.errors import ConfigError, config_fields
from fedfm.eval.metrics import rouge_l
from fedfm.fm import FoundationModel
from fedfm.models.encoders import Encoder, load_encoder
from fedfm.models.features import Pool
from fedfm.tasks.base import (
    FOUNDATION_MODEL,
    ITEM_RESULTS,
    HasFoundationModel,
    ItemResults,
    Task,
    TaskConfig,
    capable,
    require,
)
from fedfm.tasks.lm import InstructionData

log = logging.getLogger("fedfm")

ADAPTER = "global"
SELECTION_LOG = "selection.jsonl"
_SECONDS = MetaSpec("float", ge=0, required=True)

SELECT = MessageKind(
    "select",
    down_arrays=(ADAPTER,),  # absent for FedHDS-Turbo: its features need no adapter
    down_meta=("send",),
    up_arrays=("centroids", "points"),
    up_meta=("num_examples", "cluster_ids", "use_all", "feature_s", "cluster_s"),
    no_grad=True,
    dp_fields=("centroids", "points"),  # with algo.dp_sigma > 0; the other fields are not
    meta_specs={
        "send": MetaSpec("str", required=True),
        "use_all": MetaSpec("bool", required=True),
        "cluster_ids": MetaSpec("any"),
        "feature_s": _SECONDS,
        "cluster_s": _SECONDS,
    },
)
TRAIN = MessageKind(
    "train",
    down_arrays=(ADAPTER,),
    down_meta=("plan", "pick"),
    up_arrays=(ADAPTER,),
    up_meta=("num_examples", "loss", "pool_examples", "train_s"),
    meta_specs={
        "plan": MetaSpec("str", required=True),
        "pick": MetaSpec("any", required=True),
        "pool_examples": MetaSpec("int", ge=1, required=True),
        "train_s": _SECONDS,
    },
)


class FedHDSConfig(AlgoConfig):
    """FedHDS settings; ``(ours)`` marks defaults the paper does not fix."""

    selection: str = Field("hierarchical", description="a selection of SELECTIONS")
    min_cluster_size: int = Field(
        5, ge=2, description="intra-client HDBSCAN (paper: 5 for Natural-Instructions, 2 Dolly)"
    )
    server_min_cluster_size: int = Field(2, ge=2, description="inter-client HDBSCAN (paper: 2)")
    min_samples: int | None = Field(
        None,
        ge=1,
        description="intra-client HDBSCAN neighbours, the point not counted (the hdbscan"
        " package's count); None: min_cluster_size, as the official code",
    )
    server_min_samples: int | None = Field(
        None, ge=1, description="inter-client HDBSCAN neighbours; None: server_min_cluster_size"
    )
    perplexity: float = Field(30.0, ge=1, description="t-SNE perplexity cap: min(this, n - 1)")
    feature_model: str | None = Field(
        None, description="FedHDS-Turbo's frozen feature model (ENCODERS); None: the LLM"
    )
    feature_model_args: dict[str, Any] = Field(default_factory=dict)
    feature_batch_size: int = Field(8, ge=1, description="texts per feature pass (ours)")
    feature_pool: Literal["auto", "last", "mean"] = Field(
        "auto",
        description="token pooling per layer; auto: the feature model's own (a causal LM's last"
        " token, a BERT-style encoder's mean over its non-padding tokens)",
    )
    dp_sigma: float = Field(0.0, ge=0, description="Gaussian noise std on tanh'd centroids")
    dp_scale: float = Field(1.0, gt=0, description="coordinates are divided by it before tanh")
    random_budget: float = Field(
        0.015, gt=0, le=1, description="share of each client's rows of the random baseline"
    )
    server_opt: ServerOptConfig = Field(default_factory=ServerOptConfig)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)

    @field_validator("selection")
    @classmethod
    def _known_selection(cls, v: str) -> str:
        SELECTIONS.get(v)  # UnknownNameError names algo.selection and the choices
        return v


# ----------------------------------------------------------------------------- features


def flatten_features(feats: Tensor) -> np.ndarray:
    """``(n, layers + 1, hidden)`` features as ``(n, (layers + 1) · hidden)`` float64 rows."""
    return feats.reshape(feats.shape[0], -1).double().numpy()


# ----------------------------------------------------------------------------- the exchange


@dataclass
class Plan:
    """What the server decided for a round's training, and what it cost.

    Attributes:
        train: Client id -> ``(coreset rule, picks)`` of its ``train`` message (see
            :data:`~fedfm.algorithms.fedhds_selection.CORESETS`); clients not named are not
            asked to train.
        pool: Client id -> its usable rows, for clients that said.
        feature_s: Client feature-extraction seconds, summed.
        cluster_s: Client t-SNE + HDBSCAN seconds, summed.
        select_s: The server's own selection seconds.
        log: Rows for the selection log.
        metrics: Extra metrics of the round.
    """

    train: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    pool: dict[str, int] = field(default_factory=dict)
    feature_s: float = 0.0
    cluster_s: float = 0.0
    select_s: float = 0.0
    log: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _ids(reply: Message) -> list[int]:
    ids = reply.meta.get("cluster_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"cluster_ids must be a list of ints, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"cluster_ids repeat an id: {ids!r}")
    return [int(i) for i in ids]


def _coords(reply: Message, name: str, k: int | None) -> np.ndarray:
    """A reply's ``(k, 2)`` coordinates, checked (the server never trusts a client)."""
    t = reply.arrays.get(name, {}).get("xy")
    if t is None:
        return np.zeros((0, 2))
    if t.ndim != 2 or t.shape[1] != 2 or (k is not None and t.shape[0] != k):
        raise ValueError(f"'{name}' has shape {tuple(t.shape)}, expected ({k}, 2)")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"'{name}' is not finite")
    return t.double().numpy()


# ----------------------------------------------------------------------------- the algorithm

# Errors of the feature model's builder, named by the config fields that supplied the values.
FEATURE_FIELDS = {
    "encoder": "algo.feature_model",
    "encoder.options": "algo.feature_model_args",
    "features.model": "algo.feature_model",
    "model.name": "algo.feature_model",
    "model": "algo.feature_model_args",
}
TOTALS = ("coreset", "pool", "train_s", "feature_s", "cluster_s", "select_s")


class Features:
    """What FedHDS reads of a client's rows, built from the config by each half that needs it.

    The client half's selection, and the server's in the non-private ``centralised``
    baseline. FedHDS-Turbo's frozen feature model is loaded once per process
    (:func:`fedfm.models.encoders.load_encoder`).
    """

    def __init__(self, cfg: FedHDSConfig, task: Task) -> None:
        self.cfg = cfg
        self.task = task
        self.fm: FoundationModel = capable(task, HasFoundationModel).foundation_model()
        self._feature_model: Encoder | None = None
        self._usable: dict[str, tuple[list[int], list[list[int]]]] = {}
        if self.turbo:
            self.feature_model()  # a bad feature model fails at build time, naming its field

    @property
    def turbo(self) -> bool:
        """Whether features come from a separate frozen model (FedHDS-Turbo)."""
        return self.cfg.feature_model is not None

    def feature_model(self) -> Encoder:
        """FedHDS-Turbo's frozen feature model (an encoder with layers), loaded once."""
        if self._feature_model is None:
            assert self.cfg.feature_model is not None
            with config_fields(FEATURE_FIELDS):
                model = load_encoder(
                    self.cfg.feature_model, self.task.device, **self.cfg.feature_model_args
                )
                model.stack()  # an encoder without per-layer features is refused here
            self._feature_model = model
        return self._feature_model

    def raw_features(self, data: Any, cid: str) -> np.ndarray:
        """``(n, (layers + 1) · hidden)`` float64 features of a client's usable rows.

        The LLM reads each row as it is trained on, with the adapter now in the ``global``
        slot; FedHDS-Turbo's model reads the raw text.
        """
        rows = _instruction_data(data)
        positions, tokens = self.usable(cid, rows)
        if self.turbo:
            feats = self.feature_model().layer_features(
                [_raw_text(rows.rows[i]) for i in positions],
                batch_size=self.cfg.feature_batch_size,
                pool=self.pool,
            )
        else:
            feats = self.fm.features(
                tokens,
                [ADAPTER],
                batch_size=self.cfg.feature_batch_size,
                pool=self.pool,
            )
        return flatten_features(feats)

    @property
    def pool(self) -> Pool | None:
        """``algo.feature_pool``; None (``auto``): the feature model's own pooling."""
        return None if self.cfg.feature_pool == "auto" else self.cfg.feature_pool

    def usable(self, cid: str, rows: InstructionData) -> tuple[list[int], list[list[int]]]:
        """Positions and token ids of the client's trainable rows, as training encodes them.

        Rows with an empty answer are dropped, as in training; cached per process (the data
        never change).
        """
        if cid not in self._usable:
            positions, tokens = [], []
            for i, row in enumerate(rows.rows):
                for enc in self.fm.encode([row]):
                    positions.append(i)
                    tokens.append(list(enc["input_ids"]))
            self._usable[cid] = (positions, tokens)
        return self._usable[cid]


class FedHDSClient(ClientHalf):
    """FedHDS's client half: features, t-SNE and HDBSCAN (``select``), coreset training."""

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        assert isinstance(cfg, FedHDSConfig), type(cfg)
        self.cfg: FedHDSConfig = cfg
        self.fm: FoundationModel = capable(task, HasFoundationModel).foundation_model()
        self.features = Features(cfg, task)

    @override
    def handlers(self) -> dict[str, Handler]:
        return {"select": self.select, "train": self.train}

    def _slot(self, msg: Message) -> contextlib.AbstractContextManager[Any]:
        """The message's adapter in the ``global`` slot (none in FedHDS-Turbo's ``select``)."""
        if ADAPTER not in msg.arrays:
            return contextlib.nullcontext()
        return self.fm.slot(ADAPTER, msg.arrays[ADAPTER])

    def _features(self, ctx: ClientContext) -> np.ndarray:
        """Features of this client; FedHDS-Turbo's are computed once and kept in its state."""
        if not self.features.turbo:
            return self.features.raw_features(ctx.data, ctx.cid)
        cached = ctx.state.get_group("turbo")
        if cached:
            return cached["features"].double().numpy()
        x = self.features.raw_features(ctx.data, ctx.cid)
        ctx.state.set_group("turbo", {"features": torch.from_numpy(x).float()})
        return x

    def select(self, ctx: ClientContext, msg: Message) -> Message:
        """Features, t-SNE and HDBSCAN; replies centroids and ids, ids only, or every point."""
        with self._slot(msg):
            return self._select(ctx, msg)

    def _select(self, ctx: ClientContext, msg: Message) -> Message:
        t0 = time.perf_counter()
        x = self._features(ctx)
        n = len(x)
        t1 = time.perf_counter()
        meta: dict[str, Any] = {"num_examples": n}
        if n < max(2, self.cfg.min_cluster_size):
            log.info(
                "round %d: client %s has %d rows, too few to cluster: uses all", ctx.rnd, ctx.cid, n
            )
            ctx.state.meta["fedhds"] = {"round": ctx.rnd, "reps": {}}
            meta.update(use_all=True, feature_s=t1 - t0, cluster_s=0.0)
            return Message("select", meta=meta)
        points = embed_2d(x, ctx.rng_seed("tsne"), self.cfg.perplexity)
        found = cluster(points, self.cfg.min_cluster_size, self.cfg.min_samples)
        t2 = time.perf_counter()
        ctx.state.meta["fedhds"] = {
            "round": ctx.rnd,
            "reps": {str(g): int(i) for g, i in enumerate(found.nearest)},
        }
        meta.update(use_all=False, feature_s=t1 - t0, cluster_s=t2 - t1)
        send = msg.meta["send"]
        arrays: dict[str, dict[str, Tensor]] = {}
        if send == "centroids":
            meta["cluster_ids"] = list(range(found.k))
            arrays["centroids"] = {"xy": self._release(ctx, found.centres)}
        elif send == "ids":
            meta["cluster_ids"] = list(range(found.k))
        elif send == "points":
            arrays["points"] = {"xy": self._release(ctx, points)}
        else:
            raise ValueError(f"unknown select request {send!r}")
        return Message("select", arrays, meta)

    def _release(self, ctx: ClientContext, xy: np.ndarray) -> Tensor:
        """Coordinates as they leave the client: tanh and noise under DP, else as they are."""
        if self.cfg.dp_sigma > 0:
            rng = np.random.default_rng(noise_seed(ctx, "dp", self.run.privacy.noise))
            xy = privatise(xy, self.cfg.dp_sigma, rng, self.cfg.dp_scale)
        return torch.from_numpy(np.asarray(xy, dtype=np.float32).reshape(-1, 2))

    def representatives(self, ctx: ClientContext) -> dict[str, int]:
        """Cluster id -> row position of this round's representatives (set by ``select``)."""
        saved = ctx.state.meta.get("fedhds") or {}
        if saved.get("round") != ctx.rnd:
            raise ValueError(f"client {ctx.cid} has no clusters of round {ctx.rnd}")
        return dict(saved["reps"])

    def train(self, ctx: ClientContext, msg: Message) -> Message:
        """LoRA training on the coreset the plan names (see :data:`CORESETS`)."""
        with self._slot(msg):
            return self._train(ctx, msg)

    def _train(self, ctx: ClientContext, msg: Message) -> Message:
        rows = _instruction_data(ctx.data)
        keep = self.features.usable(ctx.cid, rows)[0]
        pick = msg.meta["pick"]
        assert isinstance(pick, list)
        req = CoresetRequest(
            pick=[int(p) for p in pick],
            n=len(keep),
            representatives=lambda: self.representatives(ctx),
            budget=self.cfg.random_budget,
            seed=ctx.rng_seed("random-rows"),
        )
        positions = CORESETS.get(str(msg.meta["plan"]))(req)
        ids = rows.ids()
        coreset = rows.subset([ids[keep[p]] for p in positions])
        cfg = client_config(ctx, self.run.train)
        t0 = time.perf_counter()
        batches = self.task.batches(coreset, cfg.batch_size, ctx.rng_seed("batches"))
        with self.fm.use([ADAPTER], [ADAPTER]) as model:
            res = local_train(model, batches, self.task.loss, cfg, num_steps(cfg, len(coreset)))
        meta: dict[str, MetaValue] = {
            "num_examples": len(coreset),
            "loss": res.loss,
            "pool_examples": len(keep),
            "train_s": time.perf_counter() - t0,
        }
        return Message("train", {ADAPTER: self.fm.get_adapter(ADAPTER)}, meta)


class FedHDS(Algorithm):
    """FedHDS / FedHDS-Turbo and their selection baselines (see the module doc)."""

    Config = FedHDSConfig
    Client = FedHDSClient
    messages = (SELECT, TRAIN)

    def __init__(self, cfg: FedHDSConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedHDSConfig = cfg
        self.fm: FoundationModel = capable(task, HasFoundationModel).foundation_model()
        with self.fm.slot(ADAPTER, None, seed=run.seed):  # the seeded init
            self.params: dict[str, Tensor] = self.fm.get_adapter(ADAPTER)
        self.opt = ServerOptimizer(cfg.server_opt, cfg.aggregator)
        self.selection = SELECTIONS.get(cfg.selection)
        self.clusters = ClusterSettings(
            cfg.min_cluster_size,
            cfg.min_samples,
            cfg.server_min_cluster_size,
            cfg.server_min_samples,
        )
        self.features = Features(cfg, task)  # the centralised baseline reads client rows
        self.totals = dict.fromkeys(TOTALS, 0.0)

    @classmethod
    @override
    def check_task(cls, cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        require(task_cls, task_cfg, FOUNDATION_MODEL, "task.kind", "FedHDS's LLM")
        require(task_cls, task_cfg, ITEM_RESULTS, "task.kind", "FedHDS's Rouge-L of every item")

    @property
    def turbo(self) -> bool:
        """Whether features come from a separate frozen model (FedHDS-Turbo)."""
        return self.features.turbo

    @classmethod
    @override
    def kinds_for(cls, cfg: AlgoConfig, run: RunConfig) -> dict[str, MessageKind]:
        """With DP the ``select`` kind's coordinates are DP outputs.

        Its counts, cluster ids and timings, and the ``train`` kind's adapter, still leave
        the client unnoised (the audit marks them, the report lists them).
        """
        kinds = super().kinds_for(cfg, run)
        if isinstance(cfg, FedHDSConfig) and cfg.dp_sigma > 0:
            kinds["select"] = kinds["select"].noised()
        return kinds

    # ----- server half -----
    def select_message(self, send: str) -> Message:
        """The ``select`` message: the global adapter unless features come from Turbo's model."""
        arrays = {} if self.turbo else {ADAPTER: self.params}
        return Message("select", arrays, {"send": send})

    def register_release(self, cid: str, k: int) -> None:
        """Registers one DP release of ``k`` 2-D points by client ``cid`` (when DP is on)."""
        if self.cfg.dp_sigma > 0 and k > 0:
            self.privacy.add_gaussian(
                cid, self.cfg.dp_sigma, release_sensitivity(k), name="centroids"
            )

    def plan_round(self, fed: Federation, cids: list[str]) -> Plan:
        """The selection exchange (if any), then the selection rule on what it returned."""
        send = self.selection.send
        if send == "server":
            received, plan = self._read_clients(fed, cids)
        elif send is not None:
            received, plan = self._ask(fed, cids, send)
        else:
            received, plan = Received(list(cids)), Plan()
        t0 = time.perf_counter()
        choice = self.selection.rule(received, self.clusters)
        plan.select_s += time.perf_counter() - t0
        plan.train.update(choice.train)
        plan.log += choice.log
        plan.metrics = choice.metrics
        return plan

    def _ask(self, fed: Federation, cids: list[str], send: str) -> tuple[Received, Plan]:
        """Sends ``select`` to the clients; the replies worth clustering, checked.

        Small clients are planned to train on everything; bad replies are dropped with one
        warning each; every release of coordinates is registered (under DP).
        """
        msg = self.select_message(send)
        plan = Plan()
        received = Received(list(cids), plan.pool)
        for cid, r in fed.send({c: msg for c in cids}).items():
            plan.pool[cid] = int(meta_number(r, "num_examples"))
            plan.feature_s += meta_number(r, "feature_s")
            plan.cluster_s += meta_number(r, "cluster_s")
            if r.meta.get("use_all"):
                received.use_all.append(cid)
                plan.train[cid] = ("all", [])
                plan.log.append({"client": cid, "n": plan.pool[cid], "use_all": True})
                continue
            try:
                ids = _ids(r)
                centroids = _coords(r, "centroids", len(ids))
                points = _coords(r, "points", plan.pool[cid] if "points" in r.arrays else None)
            except ValueError as e:
                log.warning("round %d: client %s: select reply dropped: %s", fed.rnd, cid, e)
                continue
            if send in ("centroids", "ids"):
                received.clusters[cid] = ids
            if send == "centroids":
                received.coords[cid] = centroids
                self.register_release(cid, len(ids))
            elif send == "points":
                received.coords[cid] = points
                self.register_release(cid, len(points))
        return received, plan

    def _read_clients(self, fed: Federation, cids: list[str]) -> tuple[Received, Plan]:
        """The centralised baseline (NOT PRIVATE): the server reads the sampled clients' rows.

        One t-SNE over the pooled features gives every row's 2-D point; a pool too small to
        cluster gives none (every client then trains on all its rows).
        """
        t0 = time.perf_counter()
        with self.fm.slot(ADAPTER, self.params):
            feats = {
                cid: self.features.raw_features(self.task.client_data(cid), cid) for cid in cids
            }
        plan = Plan(pool={cid: len(x) for cid, x in feats.items()})
        received = Received(list(cids), plan.pool)
        pooled = np.concatenate(list(feats.values()))
        if len(pooled) >= max(2, self.cfg.min_cluster_size):
            seed = derive_seed(self.run.seed, fed.rnd, "centralised")
            points = embed_2d(pooled, seed, self.cfg.perplexity)
            ends = np.cumsum([len(x) for x in feats.values()])[:-1]
            received.coords = dict(zip(feats, np.split(points, ends), strict=True))
        plan.select_s = time.perf_counter() - t0  # features included: the server computes them
        return received, plan

    @override
    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        plan = self.plan_round(fed, cids)
        msgs = {
            cid: Message("train", {ADAPTER: self.params}, {"plan": p, "pick": list(pick)})
            for cid, (p, pick) in plan.train.items()
        }
        loss = MetricMean("loss")
        coreset, train_s = 0, 0.0

        def each(cid: str, r: Message) -> None:
            nonlocal coreset, train_s
            loss.add(r)
            coreset += int(meta_number(r, "num_examples"))
            train_s += meta_number(r, "train_s")
            plan.pool.setdefault(cid, int(meta_number(r, "pool_examples")))

        like = {ADAPTER: self.params}
        got = self.aggregate(fed, msgs, ADAPTER, self.params, self.opt.round_sum, like, each)
        trained = got.clients
        if got.result is not None:
            self.params = self.opt.apply_delta(self.params, got.result)
        pool = sum(plan.pool.values())
        self._log(fed.rnd, plan, trained)
        metrics = {
            "clients": float(len(cids)),
            "clients_trained": float(loss.count),
            "coreset": float(coreset),
            "data_fraction": coreset / pool if pool else 0.0,
            "train_s": train_s,
            "feature_s": plan.feature_s,
            "cluster_s": plan.cluster_s,
            "select_s": plan.select_s,
            "client_s": train_s + plan.feature_s + plan.cluster_s,
            **plan.metrics,
        }
        if loss.count:
            metrics["train_loss"] = loss.mean("loss")
        for key, value in (("coreset", coreset), ("pool", pool), ("train_s", train_s)):
            self.totals[key] += value
        for key in ("feature_s", "cluster_s", "select_s"):
            self.totals[key] += getattr(plan, key)
        return metrics

    def _log(self, rnd: int, plan: Plan, trained: list[str]) -> None:
        rows = [{"round": rnd, **row} for row in plan.log]
        for row in rows:
            if row.get("client") is not None:
                row["trained"] = row["client"] in trained
        self.artefacts.append_jsonl(SELECTION_LOG, rows)

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        """The task's metrics plus Rouge-L of every item against its reference."""
        with self.fm.slot(ADAPTER, self.params), self.fm.use([ADAPTER]) as model:
            metrics, items = capable(self.task, ItemResults).evaluate_items(
                model, self.task.test_data()
            )
        # Every item with its Rouge-L goes to the run's eval_items.jsonl (paired statistics).
        rows = [{**i, "rougeL": _rouge_of(i)} for i in items]
        return {**metrics, **rouge_all(items), "items": rows}

    @override
    def export_adapter(self, folder: Path) -> bool:
        with self.fm.slot(ADAPTER, self.params):
            self.fm.save_adapter(ADAPTER, folder)
        return True

    @override
    def finish(self, fed: Federation) -> dict[str, float]:
        t = self.totals
        client_s = t["train_s"] + t["feature_s"] + t["cluster_s"]
        return {
            **{f"total_{k}": v for k, v in t.items()},
            "total_client_s": client_s,
            "data_fraction": t["coreset"] / t["pool"] if t["pool"] else 0.0,
        }

    @override
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        arrays = join_groups({"params": self.params, "opt": self.opt.state_dict()})
        return arrays, {"totals": dict(self.totals)}

    @override
    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.params = get_group(arrays, "params")
        self.opt.load_state_dict(get_group(arrays, "opt"))
        self.totals = {k: float(meta.get("totals", {}).get(k, 0.0)) for k in TOTALS}


def rouge_all(items: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Rouge-L of every evaluated item against its reference, whatever its own metric.

    Natural-Instructions scores every task, classification included, by Rouge-L against the
    reference; here that is ``rougeL_all`` (the mean over domains of each domain's mean, so
    every domain weighs the same, as the task's ``score``), ``rougeL_all/<domain>`` and, for
    a held-out domain, ``zeroshot/rougeL_all``.
    """
    by: dict[tuple[bool, str], list[float]] = {}
    for item in items:
        by.setdefault((bool(item.get("zeroshot")), str(item["domain"])), []).append(_rouge_of(item))
    out: dict[str, float] = {}
    for zeroshot in (False, True):
        means = {d: float(np.mean(v)) for (z, d), v in sorted(by.items()) if z == zeroshot}
        if not means:
            continue
        prefix = "zeroshot/" if zeroshot else ""
        out[f"{prefix}rougeL_all"] = float(np.mean(list(means.values())))
        if not zeroshot:
            out.update({f"rougeL_all/{d}": m for d, m in means.items()})
    return out


def _rouge_of(item: Mapping[str, Any]) -> float:
    return rouge_l(str(item["answer"]), str(item["reference"]))


def _instruction_data(data: Any) -> InstructionData:
    if not isinstance(data, InstructionData):
        raise ConfigError("task.kind", "FedHDS selects instruction rows (task kind instruction)")
    return data


def _raw_text(row: Mapping[str, Any]) -> str:
    """What FedHDS-Turbo's model reads: instruction, input and output, one per line."""
    parts: Sequence[Any] = (row.get("instruction"), row.get("input"), row.get("output"))
    return "\n".join(str(p) for p in parts if p)


ALGORITHMS.register("fedhds", "FedHDS: hierarchical data selection for instruction tuning")(FedHDS)
