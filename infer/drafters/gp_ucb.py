"""Gaussian-process UCB over the unit cube: SWIFT's Bayesian step (Xia et al., ICLR 2025) without bayes_opt.

SWIFT's evaluation code (``evaluation_llama/inference_swift.py``) asks ``bayes_opt`` 1.5.1 for a point in
[0, 1]^D, one coordinate per skippable sublayer, and skips the sublayers with the n largest coordinates. As
configured there, that is:

- a GP with an isotropic Matern-5/2 kernel on targets normalised to mean 0 and standard deviation 1, a
  noise term ``alpha = 1e-2`` on the diagonal, and its length scale fitted by maximum marginal likelihood
  (sklearn's ``GaussianProcessRegressor``, ``normalize_y=True``);
- the acquisition UCB = mu + kappa * sigma with kappa = 2.5 (``UtilityFunction(kind="ucb", kappa=2.5)``);
- maximised over 10 000 uniform random points, then refined by L-BFGS-B from the best of them, the best
  observed point and 10 random points (``acq_max``).

This module does the same in torch: the length scale is fitted by a log-spaced grid plus golden-section
refinement of the log marginal likelihood (deterministic, no restarts needed in one dimension), and the
refinement is projected gradient ascent of UCB inside the cube from the same kinds of starting points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from layerskip_core.errors import UserError

SQRT5 = math.sqrt(5.0)


@dataclass
class GPUCBConfig:
    """Settings of the GP-UCB optimiser (defaults: SWIFT's bayes_opt configuration)."""

    kappa: float = 2.5
    """Exploration weight of UCB = mu + kappa * sigma (SWIFT: 2.5)."""
    noise: float = 1e-2
    """Added to the kernel diagonal, in units of the normalised target variance (SWIFT: ``alpha=1e-2``)."""
    random_points: int = 10_000
    """Uniform random points the acquisition is evaluated at (bayes_opt's ``n_warmup``)."""
    refine_starts: int = 10
    """Random starting points of the refinement, besides the best random point and the best observed one."""
    refine_steps: int = 50
    """Projected gradient-ascent steps of the refinement."""
    refine_lr: float = 0.02
    """Step size (Adam) of the refinement, in units of the cube's side."""
    length_scale_bounds: tuple[float, float] = (1e-2, 1e3)
    """Range searched for the kernel's length scale."""
    chunk: int = 2048
    """Candidate points evaluated at once (bounds memory: chunk x observations)."""

    def __post_init__(self) -> None:
        low, high = self.length_scale_bounds
        checks = [
            (self.kappa >= 0, f"kappa must be >= 0, got {self.kappa}"),
            (self.noise > 0, f"noise must be > 0, got {self.noise}"),
            (self.random_points >= 1 and self.chunk >= 1, "random-points and chunk must be >= 1"),
            (self.refine_starts >= 0 and self.refine_steps >= 0, "refine-starts and refine-steps must be >= 0"),
            (self.refine_lr > 0, f"refine-lr must be > 0, got {self.refine_lr}"),
            (0 < low < high, f"length-scale bounds must satisfy 0 < low < high, got {self.length_scale_bounds}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)


def matern52(a: Tensor, b: Tensor, length_scale: float | Tensor) -> Tensor:
    """(n, m) Matern-5/2 kernel with unit variance between rows of a (n, D) and b (m, D)."""
    r = torch.cdist(a, b) / length_scale  # (n, m)
    return (1.0 + SQRT5 * r + (5.0 / 3.0) * r * r) * torch.exp(-SQRT5 * r)


def _kernel_from_distance(dist: Tensor, length_scale: float) -> Tensor:
    r = dist / length_scale  # (n, n)
    return (1.0 + SQRT5 * r + (5.0 / 3.0) * r * r) * torch.exp(-SQRT5 * r)


@dataclass
class Posterior:
    """A fitted GP: what predicting at new points needs."""

    x: Tensor
    """(n, D) observed points."""
    chol: Tensor
    """(n, n) lower Cholesky factor of K + noise * I."""
    alpha: Tensor
    """(n,) (K + noise * I)^-1 y on normalised targets."""
    length_scale: float
    """Fitted kernel length scale."""

    def ucb(self, points: Tensor, kappa: float) -> Tensor:
        """(m,) mu + kappa * sigma at points (m, D), in normalised target units."""
        ks = matern52(points, self.x, self.length_scale)  # (m, n)
        mean = ks @ self.alpha  # (m,)
        v = torch.linalg.solve_triangular(self.chol, ks.T, upper=False)  # (n, m)
        var = (1.0 - (v * v).sum(0)).clamp_min(0.0)  # (m,) latent variance (unit prior variance)
        return mean + kappa * var.add(1e-12).sqrt()


class GPUCB:
    """Maximises a black-box function on [0, 1]^D from scored points: ``observe`` scores, ``suggest`` the next point."""

    def __init__(self, dim: int, seed: int = 0, config: GPUCBConfig | None = None):
        self.dim = dim
        self.config = config or GPUCBConfig()
        self.generator = torch.Generator().manual_seed(seed)
        self.xs: list[Tensor] = []
        self.ys: list[float] = []
        self.length_scale: float | None = None

    def observe(self, x: Tensor, y: float) -> None:
        """Record the score y of point x (D,) in [0, 1]^D (duplicates allowed, as in SWIFT's optimiser)."""
        self.xs.append(x.detach().to(torch.float64).flatten().cpu())
        self.ys.append(float(y))

    def suggest(self) -> Tensor:
        """(D,) the point of largest UCB under the GP fitted to every observation (uniform when there is none)."""
        if not self.xs:
            return self._uniform(1)[0]
        posterior = self.fit()
        best_random = self._best_random(posterior)
        incumbent = self.xs[max(range(len(self.ys)), key=self.ys.__getitem__)]
        starts = torch.cat([best_random[None], incumbent[None], self._uniform(self.config.refine_starts)])  # (S, D)
        refined = self._refine(posterior, starts)  # (S, D)
        candidates = torch.cat([best_random[None], refined])  # (S + 1, D)
        return candidates[posterior.ucb(candidates, self.config.kappa).argmax()]

    # ------------------------------------------------------------------ the GP
    def fit(self) -> Posterior:
        """Normalise the targets and fit the length scale by maximum log marginal likelihood."""
        x = torch.stack(self.xs)  # (n, D)
        y = torch.tensor(self.ys, dtype=torch.float64)  # (n,)
        std = y.std(unbiased=False)
        y = (y - y.mean()) / (std if std > 0 else 1.0)
        dist = torch.cdist(x, x)  # (n, n)
        scale = self._fit_length_scale(dist, y)
        chol, alpha = self._solve(dist, y, scale)
        self.length_scale = scale
        return Posterior(x, chol, alpha, scale)

    def _solve(self, dist: Tensor, y: Tensor, length_scale: float) -> tuple[Tensor, Tensor]:
        k = _kernel_from_distance(dist, length_scale)  # (n, n)
        k.diagonal().add_(self.config.noise)
        chol = torch.linalg.cholesky(k)  # (n, n)
        alpha = torch.cholesky_solve(y[:, None], chol)[:, 0]  # (n,)
        return chol, alpha

    def _log_marginal_likelihood(self, dist: Tensor, y: Tensor, log_scale: float) -> float:
        chol, alpha = self._solve(dist, y, math.exp(log_scale))
        n = y.shape[0]
        return float(-0.5 * (y @ alpha) - chol.diagonal().log().sum() - 0.5 * n * math.log(2 * math.pi))

    def _fit_length_scale(self, dist: Tensor, y: Tensor, grid: int = 11, golden_steps: int = 12) -> float:
        """Grid over log length scale, then golden-section search between the best grid point's neighbours."""
        low, high = (math.log(b) for b in self.config.length_scale_bounds)
        points = [low + (high - low) * i / (grid - 1) for i in range(grid)]
        values = [self._log_marginal_likelihood(dist, y, p) for p in points]
        best = max(range(grid), key=values.__getitem__)
        a, b = points[max(best - 1, 0)], points[min(best + 1, grid - 1)]
        ratio = (math.sqrt(5.0) - 1) / 2
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        fc, fd = self._log_marginal_likelihood(dist, y, c), self._log_marginal_likelihood(dist, y, d)
        for _ in range(golden_steps):
            if fc >= fd:
                b, d, fd = d, c, fc
                c = b - ratio * (b - a)
                fc = self._log_marginal_likelihood(dist, y, c)
            else:
                a, c, fc = c, d, fd
                d = a + ratio * (b - a)
                fd = self._log_marginal_likelihood(dist, y, d)
        found, value = (c, fc) if fc >= fd else (d, fd)
        return math.exp(found if value >= values[best] else points[best])

    # ------------------------------------------------------------------ the acquisition
    def _uniform(self, count: int) -> Tensor:
        return torch.rand(count, self.dim, generator=self.generator, dtype=torch.float64)  # (count, D)

    def _best_random(self, posterior: Posterior) -> Tensor:
        """(D,) the best of ``random_points`` uniform points by UCB (evaluated in chunks)."""
        best, best_value = None, -math.inf
        left = self.config.random_points
        while left > 0:
            points = self._uniform(min(left, self.config.chunk))  # (c, D)
            left -= points.shape[0]
            values = posterior.ucb(points, self.config.kappa)  # (c,)
            i = int(values.argmax())
            if float(values[i]) > best_value:
                best, best_value = points[i], float(values[i])
        return best

    @torch.enable_grad()  # gradient ascent needs autograd, whatever mode its caller runs in (the engine: no_grad)
    def _refine(self, posterior: Posterior, starts: Tensor, beta1: float = 0.9, beta2: float = 0.999) -> Tensor:
        """(S, D) projected gradient ascent of UCB from each start (Adam steps, clamped to the cube).

        Written out rather than ``torch.optim.Adam``, whose first construction imports torch's compiler
        stack (about 2 s on this CPU) for a few dozen steps on a (S, D) tensor.
        """
        points = starts.clone()  # (S, D)
        m, v = torch.zeros_like(points), torch.zeros_like(points)
        for step in range(1, self.config.refine_steps + 1):
            points.requires_grad_(True)
            (grad,) = torch.autograd.grad(posterior.ucb(points, self.config.kappa).sum(), points)  # (S, D)
            m = beta1 * m + (1 - beta1) * grad
            v = beta2 * v + (1 - beta2) * grad * grad
            m_hat, v_hat = m / (1 - beta1 ** step), v / (1 - beta2 ** step)
            with torch.no_grad():
                points = (points + self.config.refine_lr * m_hat / (v_hat.sqrt() + 1e-8)).clamp(0.0, 1.0)
        return points.detach()
