"""GP-UCB (SWIFT's Bayesian step): the posterior's arithmetic, the length-scale fit, seeded search on the cube."""

import math

import pytest
import torch

from infer.drafters.gp_ucb import GPUCB, GPUCBConfig, matern52
from layerskip_core.errors import UserError


def scored(dim: int, count: int, f, seed: int = 0) -> GPUCB:
    gp = GPUCB(dim, seed=seed, config=GPUCBConfig(random_points=2000))
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(count):
        x = torch.rand(dim, generator=g, dtype=torch.float64)
        gp.observe(x, f(x))
    return gp


def test_posterior_is_the_textbook_formula():
    """UCB = mu + kappa * sigma of a zero-mean unit-variance GP on normalised targets, noise on the diagonal."""
    gp = scored(5, 12, lambda x: float(torch.sin(4 * x).sum()))
    post = gp.fit()
    x = torch.stack(gp.xs)
    y = torch.tensor(gp.ys, dtype=torch.float64)
    y = (y - y.mean()) / y.std(unbiased=False)
    k_inv = torch.linalg.inv(matern52(x, x, post.length_scale) + gp.config.noise * torch.eye(12, dtype=torch.float64))
    test = torch.rand(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ks = matern52(test, x, post.length_scale)  # (7, 12)
    mean = ks @ k_inv @ y
    std = (1 - ((ks @ k_inv) * ks).sum(1)).clamp_min(0).add(1e-12).sqrt()
    torch.testing.assert_close(post.ucb(test, 2.5), mean + 2.5 * std, rtol=1e-9, atol=1e-9)
    r = torch.tensor(0.7) * math.sqrt(5)  # Matern-5/2 at distance 0.7, length scale 1
    assert float(matern52(torch.zeros(1, 1), torch.full((1, 1), 0.7), 1.0)) == pytest.approx(
        float((1 + r + r * r / 3) * torch.exp(-r)))


def test_length_scale_maximises_the_marginal_likelihood():
    gp = scored(4, 20, lambda x: float(torch.cos(3 * x[0]) + x[1]))
    post = gp.fit()
    x, y = torch.stack(gp.xs), torch.tensor(gp.ys, dtype=torch.float64)
    y = (y - y.mean()) / y.std(unbiased=False)

    def log_likelihood(scale: float) -> float:  # of the normalised targets under the GP prior, noise included
        k = matern52(x, x, scale) + gp.config.noise * torch.eye(len(y), dtype=torch.float64)
        return float(torch.distributions.MultivariateNormal(torch.zeros_like(y), k).log_prob(y))

    grid = [log_likelihood(math.exp(math.log(1e-2) + i * math.log(1e5) / 400)) for i in range(401)]
    assert log_likelihood(post.length_scale) >= max(grid) - 1e-6


def test_suggestions_find_the_optimum_and_are_seeded():
    target = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)

    def f(x):
        return -float(((x - target) ** 2).sum())

    runs = []
    for _ in range(2):
        gp = scored(6, 10, f)
        start = max(gp.ys)
        points = []
        for _ in range(15):
            x = gp.suggest()
            assert x.shape == (6,) and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
            gp.observe(x, f(x))
            points.append(x)
        runs.append(torch.stack(points))
        assert max(gp.ys) > -0.05 > start  # random points were far off; UCB walked to the corner
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_no_observation_gives_a_uniform_point_and_bad_settings_are_refused():
    x = GPUCB(3, seed=0).suggest()
    assert x.shape == (3,) and 0 <= float(x.min()) <= float(x.max()) <= 1
    for bad in ({"kappa": -1.0}, {"noise": 0.0}, {"random_points": 0}, {"length_scale_bounds": (1.0, 0.5)}):
        with pytest.raises(UserError):
            GPUCBConfig(**bad)
