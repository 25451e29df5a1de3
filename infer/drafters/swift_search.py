"""SWIFT's online optimiser of a layer skip set: random search plus a periodic Bayesian step (TPE or GP-UCB).

Separate from the drafter (``infer.drafters.swift``) so each file stays readable; nothing here touches a model.
"""

from __future__ import annotations

import random
import warnings

import torch

from infer.drafters.gp_ucb import GPUCB
from infer.model.plan import LayerPlan, PlanSpace, inner_layers, uniform_plan

BAYES = ("tpe", "gp_ucb")
"""What proposes the Bayesian candidates: optuna's TPE (optional dependency) or the reference's GP-UCB."""


class LayerSetSearch:
    """SWIFT's online optimiser: random search + a Bayesian step every ``bo_interval`` steps, over skip sets of a
    fixed size.

    The search space is `layerskip search`'s (``PlanSpace``) restricted to the attention and MLP
    sublayers of layers 1..L-2 (the first and last layer always run, as in the paper), with exactly
    ``num_skip`` skips. The Bayesian step (``bayes``) is

    - ``'tpe'``: optuna's TPE sampler fitted to every scored candidate (random ones are told to it as
      completed trials); its yes/no proposal is repaired to ``num_skip`` skips (deep layers first).
      optuna is optional and imported at the first Bayesian step; without it every step is random
      search, said once (a warning, and ``method`` in the drafter's stats);
    - ``'gp_ucb'`` (``paper=true``): the reference's Gaussian-process UCB (``infer.drafters.gp_ucb``) over one value
      in [0, 1] per sublayer; the ``num_skip`` largest values are the skip set. Random candidates are
      registered as their 0/1 vectors, Bayesian ones as the continuous point they came from (as the
      reference registers them). Needs no optuna.
    """

    def __init__(self, num_layers: int, skip_ratio: float, bo_interval: int, seed: int, bayes: str = "tpe"):
        if bayes not in BAYES:
            raise ValueError(f"bayes must be one of {BAYES}, got {bayes!r}")
        slots = 2 * len(inner_layers(num_layers))
        self.space = PlanSpace(num_layers, keep_ends=True, n_skip=max(1, int(slots * skip_ratio)))
        self.num_skip = self.space.n_skip
        self.bo_interval, self.seed, self.bayes = bo_interval, seed, bayes
        self.rng = random.Random(seed)
        self.scored: list[tuple[LayerPlan, float]] = []
        self.gp = GPUCB(len(self.space.names), seed) if bayes == "gp_ucb" else None
        self.study = None  # optuna's, built at the first Bayesian step
        self._dists: dict = {}
        self.unavailable = ""  # why the Bayesian step is random search, once known
        self.steps = 0
        self.since_improved = 0

    @property
    def method(self) -> str:
        """What proposes candidates: 'tpe' or 'gp_ucb' (each with random search), or 'random' and why."""
        return f"random ({self.unavailable})" if self.unavailable else self.bayes

    def uniform_plan(self) -> LayerPlan:
        """The default starting plan: ``num_skip`` sublayers spread evenly over layers 1..L-2."""
        return uniform_plan(self.space.num_layers, self.num_skip)

    def propose(self):
        """Next candidate: (plan, proposal), proposal = the optuna trial or the GP's continuous point, or None
        for a random candidate."""
        self.steps += 1
        if self.steps % self.bo_interval == 0:
            if self.gp is not None and self.scored:
                point = self.gp.suggest()  # (D,) in [0, 1]
                return self.top_n(point), point
            study = self._tpe_study() if self.gp is None and len(self.scored) >= 2 else None
            if study is not None:
                trial = study.ask(self._dists)
                return self.space.decode(trial.params), trial
        chosen = set(self.rng.sample(self.space.names, self.num_skip))
        return self.space.decode({name: name in chosen for name in self.space.names}), None

    def record(self, plan: LayerPlan, proposal, score: float) -> None:
        """Tell the optimiser a scored candidate."""
        self.scored.append((plan, score))
        if self.gp is not None:
            self.gp.observe(self.vector(plan) if proposal is None else proposal, score)
        elif proposal is not None:
            self.study.tell(proposal, score)
        elif self.study is not None:
            self._add_trial(plan, score)

    def vector(self, plan: LayerPlan) -> torch.Tensor:
        """(D,) the plan as 0/1 per sublayer, in ``space.names`` order (attention of layers 1..L-2, then MLP)."""
        params = self.space.params(plan)
        return torch.tensor([float(params[name]) for name in self.space.names], dtype=torch.float64)

    def top_n(self, point: torch.Tensor) -> LayerPlan:
        """The plan skipping the ``num_skip`` sublayers with the largest values of ``point`` (D,); ties go to the
        earlier name (a stable sort, as the reference's ``sorted``)."""
        order = torch.argsort(point, descending=True, stable=True)[:self.num_skip].tolist()
        chosen = {self.space.names[i] for i in order}
        return self.space.decode({name: name in chosen for name in self.space.names})

    def _tpe_study(self):
        """optuna's study, built (with every candidate scored so far) at the first Bayesian step; None without
        optuna."""
        if self.study is None and not self.unavailable:
            try:
                import optuna  # optional and slow to import: only the Bayesian step needs it
            except ImportError:
                self.unavailable = "optuna not installed"
                warnings.warn("optuna is not installed: swift's Bayesian step falls back to random search "
                              "(pip install optuna, or swift:paper=true for the GP-UCB step, which needs none)",
                              RuntimeWarning, stacklevel=3)
                return None
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            self._dists = self.space.distributions()
            self.study = optuna.create_study(direction="maximize",
                                              sampler=optuna.samplers.TPESampler(seed=self.seed))
            for plan, score in self.scored:
                self._add_trial(plan, score)
        return self.study

    def _add_trial(self, plan: LayerPlan, score: float) -> None:
        import optuna  # already imported by _tpe_study

        self.study.add_trial(optuna.trial.create_trial(params=self.space.params(plan),
                                                        distributions=self._dists, value=score))
