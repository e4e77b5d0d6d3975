"""The distributed discrete Gaussian: client-side DP noise that survives the modular sum.

Papers:
    * Kairouz, Liu, Steinke. "The Distributed Discrete Gaussian Mechanism for Federated
      Learning with Secure Aggregation", ICML 2021 (arXiv:2102.06387): the client encoding
      (Algorithm 1), the conditional rounding's norm bound and the privacy of the sum of
      ``n`` discrete Gaussians (Theorem 1 with Proposition 14).
    * Canonne, Kamath, Steinke. "The Discrete Gaussian for Differential Privacy", NeurIPS 2020
      (the sampler: Algorithm 3, discrete Laplace proposals with rejection).

A client with update ``u`` (``d`` coordinates) under SecAgg+ (:mod:`fedfm.core.secagg`):

1. **Clip** in L2 to ``c`` (``privacy.user_level.clip``).
2. **Flatten**: pad to ``D = 2^⌈log2 d⌉`` and rotate by ``H·diag(s)/√D`` (``H`` the
   Walsh–Hadamard matrix, ``s`` random signs drawn from public round randomness: the run seed
   and the round; the server inverts it after unmasking).
3. **Scale** by ``1/γ`` and **round conditionally**: stochastic rounding, repeated until the
   integer vector's norm is at most ``c̃ = min(c/γ + √D, √(c²/γ² + D/4 + √(2 ln 1/β)·(c/γ +
   √D/2)))``, so one client moves the sum by at most ``Δ₂ = γ·c̃`` (Theorem 1).
4. **Noise**: add ``N_Z(0, σ²/γ²)`` per coordinate, ``σ = z·c/√M`` as the continuous share of
   :mod:`fedfm.core.userdp` (``M = min_clients``).
5. **Reduce** mod ``m`` (``privacy.secagg.modulus_range``) and mask as any SecAgg+ vector.

The server unmasks the sum, maps it to ``[−m/2, m/2)``, multiplies by ``γ`` and inverts the
rotation.

Privacy (Theorem 1 of Kairouz et al., its second form): the sum of ``n`` clients' vectors,
each noised with ``N_Z(0, σ²/γ²)``, is ``ρ``-zCDP with ``√(2ρ) = Δ₂/(√n·σ) + τ·√D``,
``τ = 10·Σ_{k=1}^{n−1} exp(−2π²(σ/γ)²·k/(k+1))``. A ``ρ``-zCDP mechanism has the Rényi
curve ``α·ρ`` of a Gaussian of multiplier ``1/√(2ρ)``; the ledger composes it as that
Gaussian with dp-accounting's RDP accountant (:data:`KIND`), never the PLD one (zCDP does not
give the Gaussian's whole privacy profile). Choices of ours: ``n`` is the fewest noise shares
a sum can hold (``M``; Δ₂/(√n·σ) falls as ``n`` grows) and ``τ`` is taken at the most clients
a round can sum (it grows with ``n``), so the bound holds for every sum the server can unmask.

Modular clipping (Sec. 4 of the paper): after flattening each coordinate of the sum of ``n``
clients' vectors is sub-Gaussian with variance proxy at most ``(n·c)²/D`` (every update
aligned, ours the worst case), plus ``n·(γ²/4 + σ²)`` of rounding and noise; ``γ`` is the
smallest with ``m·γ ≥ 2k·√(that)`` at ``k = 8`` (ours; the tail is then below ``2e^{−32}``
per coordinate), unless set (``privacy.secagg.gamma``), when the same condition is checked.

The sampler's draws use float64 for the Bernoulli probabilities (numpy's geometric and
uniform draws); the paper's rational arithmetic is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedfm.errors import ConfigError

KIND = "ddg"  # the ledger's mechanism kind (fedfm.core.privacy)
STDDEVS = 8.0  # k of the modular-clipping condition (ours)
MAX_ROUNDING_TRIES = 1000  # each try passes with probability at least 1 − β
FIELD = "privacy.secagg"


# ----------------------------------------------------------------------------- the sampler


def discrete_laplace(t: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws with ``P(y) ∝ exp(−|y|/t)`` on the integers, as int64.

    The difference of two geometric counts of failures with success probability
    ``1 − e^{−1/t}`` (Inusah & Kozubowski 2006).
    """
    p = -math.expm1(-1.0 / t)
    return rng.geometric(p, size).astype(np.int64) - rng.geometric(p, size).astype(np.int64)


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of ``N_Z(0, σ²)``: ``P(y) ∝ exp(−y²/(2σ²))`` on the integers (int64).

    Canonne, Kamath & Steinke's Algorithm 3, vectorised: propose from the discrete Laplace of
    scale ``t = ⌊σ⌋ + 1`` and accept with probability ``exp(−(|y| − σ²/t)²/(2σ²))``; the
    rejected coordinates are drawn again.
    """
    out = np.zeros(size, dtype=np.int64)
    if sigma == 0 or size == 0:
        return out
    t = math.floor(sigma) + 1
    todo = np.arange(size)
    while todo.size:
        y = discrete_laplace(t, todo.size, rng)
        keep = rng.random(todo.size) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        out[todo[keep]] = y[keep]
        todo = todo[~keep]
    return out


def discrete_gaussian_pmf(sigma: float, ys: np.ndarray) -> np.ndarray:
    """The pmf of ``N_Z(0, σ²)`` at ``ys`` (normalised over ``|y| ≤ σ·40``)."""
    support = np.arange(-math.ceil(40 * sigma) - 1, math.ceil(40 * sigma) + 2)
    z = np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma**2)).sum()
    return np.exp(-(ys.astype(np.float64) ** 2) / (2 * sigma**2)) / z


# ----------------------------------------------------------------------------- flattening


def padded(d: int) -> int:
    """``D = 2^⌈log2 d⌉``, the rotated dimension."""
    return 1 << max(0, (d - 1).bit_length())


def hadamard(x: np.ndarray) -> np.ndarray:
    """``H·x/√D`` (orthonormal Walsh–Hadamard, Sylvester order) of a length-``2^k`` vector."""
    y = np.array(x, dtype=np.float64)
    h, n = 1, y.size
    while h < n:
        v = y.reshape(-1, 2, h)
        a = v[:, 0, :].copy()
        v[:, 0, :] += v[:, 1, :]
        v[:, 1, :] = a - v[:, 1, :]
        h *= 2
    y /= math.sqrt(n)
    return y


def signs(seed: int, n: int) -> np.ndarray:
    """The rotation's random ±1 diagonal, from public round randomness."""
    return np.random.default_rng(seed).integers(0, 2, n).astype(np.float64) * 2 - 1


def rotate(x: np.ndarray, seed: int) -> np.ndarray:
    """``H·diag(s)·pad(x)/√D``."""
    v = np.zeros(padded(x.size))
    v[: x.size] = x
    return hadamard(v * signs(seed, v.size))


def unrotate(y: np.ndarray, seed: int, d: int) -> np.ndarray:
    """The inverse of :func:`rotate`: ``diag(s)·H·y/√D``, its first ``d`` coordinates."""
    return (hadamard(y) * signs(seed, y.size))[:d]


# ----------------------------------------------------------------------------- parameters


def tau(sigma_int: float, n: int) -> float:
    """``τ = 10·Σ_{k=1}^{n−1} exp(−2π²σ²·k/(k+1))`` of Theorem 1 (``σ`` in grid units)."""
    return 10 * sum(math.exp(-2 * math.pi**2 * sigma_int**2 * k / (k + 1)) for k in range(1, n))


def smallest_gamma(clip: float, sigma: float, modulus: int, dim: int, most: int) -> float:
    """The smallest ``γ`` with ``m·γ ≥ 2k·√((n·c)²/D + n·(γ²/4 + σ²))`` (``n`` = ``most``)."""
    a = (most * clip) ** 2 / dim + most * sigma**2
    room = (modulus / (2 * STDDEVS)) ** 2 - most / 4
    return math.sqrt(a / room) if room > 0 else math.inf


@dataclass(frozen=True)
class DDG:
    """One run's distributed discrete Gaussian, for a flat update of ``dim`` coordinates.

    Attributes:
        clip: ``c``, the L2 bound of a client's update.
        sigma: ``σ``, each client's noise std in the update's units.
        gamma: ``γ``, the grid step.
        beta: ``β`` of the conditional rounding.
        modulus: ``m``.
        dim: ``d``, the update's coordinates (rotated in ``D = padded(d)``).
        least: The fewest noise shares in an unmasked sum (``min_clients``).
        most: The most clients a sum can hold.
    """

    clip: float
    sigma: float
    gamma: float
    beta: float
    modulus: int
    dim: int
    least: int
    most: int

    @property
    def rotated(self) -> int:
        """``D``."""
        return padded(self.dim)

    @property
    def norm_bound(self) -> float:
        """``c̃``, the conditional rounding's bound on the integer vector's norm."""
        c, d = self.clip / self.gamma, self.rotated
        loose = c + math.sqrt(d)
        tight = math.sqrt(
            c**2 + d / 4 + math.sqrt(2 * math.log(1 / self.beta)) * (c + math.sqrt(d) / 2)
        )
        return min(loose, tight)

    @property
    def sensitivity(self) -> float:
        """``Δ₂ = γ·c̃``: how far one client moves the sum."""
        return self.gamma * self.norm_bound

    def tau(self) -> float:
        """Theorem 1's ``τ`` at the most clients a sum can hold."""
        return tau(self.sigma / self.gamma, self.most)

    def zcdp(self, n: int | None = None) -> float:
        """``ρ`` of one sum of at least ``n`` (default :attr:`least`) clients' vectors."""
        k = self.least if n is None else n
        if k <= 0 or self.sigma == 0:
            return math.inf
        root = self.sensitivity / (math.sqrt(k) * self.sigma) + self.tau() * math.sqrt(self.rotated)
        return root**2 / 2

    def multiplier(self, n: int | None = None) -> float:
        """The noise multiplier ``1/√(2ρ)`` of the Gaussian with the same Rényi curve."""
        rho = self.zcdp(n)
        return 0.0 if math.isinf(rho) else 1 / math.sqrt(2 * rho)

    def span(self) -> float:
        """``2k·√((n·c)²/D + n·(γ²/4 + σ²))``: what the sum's coordinates span, ×1/γ."""
        n = self.most
        var = (n * self.clip) ** 2 / self.rotated + n * (self.gamma**2 / 4 + self.sigma**2)
        return 2 * STDDEVS * math.sqrt(var) / self.gamma

    def note(self) -> dict[str, float | int | str]:
        """The parameters and the bound, for ``privacy.json``."""
        return {
            "mechanism": "distributed discrete Gaussian (Kairouz, Liu & Steinke, ICML 2021)",
            "theorem": (
                "Theorem 1 (second form): rho-zCDP, sqrt(2 rho) = D2/(sqrt(n) sigma) + tau sqrt(D)"
            ),
            "gamma": self.gamma,
            "beta": self.beta,
            "dimension": self.dim,
            "rotated_dimension": self.rotated,
            "client_noise_std": self.sigma,
            "client_noise_std_grid": self.sigma / self.gamma,
            "sensitivity_clip": self.clip,
            "sensitivity_rounded": self.sensitivity,
            "tau": self.tau(),
            "least_shares": self.least,
            "most_clients": self.most,
            "zcdp_rho_one_round": self.zcdp(),
            "equivalent_noise_multiplier": self.multiplier(),
            "modulus": self.modulus,
        }

    # ----- the client's encoding, the server's decoding -----
    def encode(
        self, u: np.ndarray, rotation: int, noise: np.random.Generator,
        rounding: np.random.Generator,
    ) -> np.ndarray:  # fmt: skip
        """A client's update clipped, rotated, scaled, rounded, noised, mod ``m`` (uint64).

        Raises:
            ValueError: ``u`` has another size, or the rounding missed its bound
                :data:`MAX_ROUNDING_TRIES` times (probability at most ``β`` each).
        """
        if u.size != self.dim:
            raise ValueError(f"an update of {u.size} coordinates for a DDG of {self.dim}")
        norm = float(np.linalg.norm(u))
        x = u * (min(1.0, self.clip / norm) if norm > 0 else 1.0)
        r = rotate(x, rotation) / self.gamma
        low = np.floor(r)
        frac = r - low
        bound = self.norm_bound**2
        for _ in range(MAX_ROUNDING_TRIES):
            z = low + (rounding.random(r.size) < frac)
            if float(z @ z) <= bound:
                break
        else:
            raise ValueError(f"conditional rounding missed its bound {MAX_ROUNDING_TRIES} times")
        y = z.astype(np.int64) + discrete_gaussian(self.sigma / self.gamma, r.size, noise)
        return y.view(np.uint64) & np.uint64(self.modulus - 1)  # two's complement mod 2^b

    def decode(self, total: np.ndarray, rotation: int) -> np.ndarray:
        """The unmasked sum (uint64 mod ``m``) back to the update's units (float64, ``d``)."""
        signed = total.astype(np.int64)
        signed[total >= np.uint64(self.modulus // 2)] -= self.modulus
        return unrotate(signed.astype(np.float64) * self.gamma, rotation, self.dim)


def plan(
    clip: float, sigma: float, modulus: int, dim: int, least: int, most: int,
    gamma: float | None = None, beta: float = math.exp(-0.5),
) -> DDG:  # fmt: skip
    """The run's DDG, ``γ`` the smallest the modulus allows unless given.

    Raises:
        ConfigError: A modulus that is not a power of two, too small for the scaled, noised
            sum (the modular-clipping condition), a given ``γ`` that breaks it, or a grid
            so coarse that rounding more than doubles the sensitivity.
    """
    if modulus & (modulus - 1):
        raise ConfigError(f"{FIELD}.modulus_range", f"{modulus} is not a power of two")
    D = padded(dim)
    need = smallest_gamma(clip, sigma, modulus, D, most)
    if math.isinf(need):
        raise ConfigError(
            f"{FIELD}.modulus_range",
            f"{modulus} cannot hold the sum of {most} clients' scaled, noised vectors at any"
            " grid step (the distributed discrete Gaussian's modular-clipping condition)",
        )
    if gamma is not None and gamma < need:
        raise ConfigError(
            f"{FIELD}.gamma",
            f"{gamma:g} is below {need:.4g}: the sum of {most} clients' scaled, noised vectors"
            f" would wrap around the modulus {modulus} (within {STDDEVS:g} standard deviations)",
        )
    ddg = DDG(clip, sigma, need if gamma is None else gamma, beta, modulus, dim, least, most)
    if ddg.sensitivity > 2 * clip:
        raise ConfigError(
            f"{FIELD}.gamma" if gamma is not None else f"{FIELD}.modulus_range",
            f"the grid step γ={ddg.gamma:.4g} (modulus {modulus}) is too coarse for {D}"
            f" rotated coordinates: rounding raises the sensitivity from {clip:g} to"
            f" {ddg.sensitivity:.4g}, more than double",
        )
    return ddg
