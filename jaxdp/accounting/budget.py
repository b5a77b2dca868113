"""A DP-SGD run's privacy budget: `BudgetTracker` counts steps and refuses the one that would exceed it.

The privacy spent by `steps` steps is `jaxdp.accounting.epsilon` (host-side,
no jax); the tracker adds the step count, the stop before the target epsilon
and a JSON-serialisable state for checkpoints. The training loop
(`jaxdp.training.loop`) keeps one per run.

Example::

    sigma = calibration.calibrate_noise_multiplier(8.0, sampling_probability=0.01,
                                                  steps=10_000, delta=1e-5)
    tracker = BudgetTracker(sigma, 0.01, 1e-5, target_epsilon=8.0)
    while tracker.can_step():
        ...                                    # one DP-SGD step
        tracker.step()
"""

from __future__ import annotations

from typing import Any

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import calibration


class BudgetTracker:
    """Counts DP-SGD steps and refuses the step that would exceed the budget.

    The tracker holds no RNG or accountant state: the privacy spent is a
    function of (noise_multiplier, sampling_probability, delta, steps), so
    `state_dict()` is a small JSON-serialisable dict and a restored tracker
    reports exactly the same epsilon.

    With a `target_epsilon`, the step budget `max_steps` =
    `steps_for_epsilon(target_epsilon, ...)` is computed once, on the first
    `can_step` / `step` (epsilon is nondecreasing in steps, so "steps + n <=
    max_steps" is "epsilon(steps + n) <= target"); after that both are O(1),
    so calling them every training step costs nothing even with PLD.

    Args:
      noise_multiplier: sigma used at every step, >= 0.
      sampling_probability: q, in (0, 1].
      delta: target delta, in (0, 1).
      target_epsilon: budget, > 0, or None for no limit (tracking only).
      accountant: "pld" (default) or "rdp", as in `accounting.epsilon`.
      value_discretization_interval: PLD only, as in `accounting.epsilon`.

    Example::

      >>> tracker = BudgetTracker(1.1, 0.01, 1e-5, target_epsilon=2.0, accountant="rdp")
      >>> tracker.step(1000)
      >>> round(tracker.epsilon(), 3), tracker.can_step(600)
      (1.712, False)
      >>> restored = BudgetTracker.from_state_dict(tracker.state_dict())
      >>> restored.steps, restored.epsilon() == tracker.epsilon()
      (1000, True)
    """

    # Cap for the step budget; far beyond any real run.
    _BUDGET_SEARCH_LIMIT = 2**40

    def __init__(
        self,
        noise_multiplier: float,
        sampling_probability: float,
        delta: float,
        *,
        target_epsilon: float | None = None,
        accountant: str = "pld",
        value_discretization_interval: float = accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    ):
        self.noise_multiplier = accounting._check_noise_multiplier(noise_multiplier)
        self.sampling_probability = accounting._check_sampling_probability(sampling_probability)
        self.delta = accounting._check_delta(delta)
        self.target_epsilon = (None if target_epsilon is None
                               else accounting._check_target_epsilon(target_epsilon))
        accounting._check_accountant(accountant, value_discretization_interval)
        self.accountant = accountant
        self.value_discretization_interval = float(value_discretization_interval)
        self._steps = 0
        self._epsilon_cache: tuple[int, float] | None = None  # (steps, epsilon)
        self._max_steps: int | None = None

    @property
    def steps(self) -> int:
        """Steps taken so far."""
        return self._steps

    @property
    def max_steps(self) -> int | None:
        """Total steps the budget allows (None without a target_epsilon)."""
        if self.target_epsilon is None:
            return None
        if self._max_steps is None:
            self._max_steps = calibration.steps_for_epsilon(
                self.target_epsilon, self.noise_multiplier, self.sampling_probability,
                self.delta, accountant=self.accountant,
                max_steps=self._BUDGET_SEARCH_LIMIT,
                value_discretization_interval=self.value_discretization_interval)
        return self._max_steps

    def epsilon(self) -> float:
        """Epsilon spent by the steps taken so far (cached per step count)."""
        if self._epsilon_cache is None or self._epsilon_cache[0] != self._steps:
            self._epsilon_cache = (self._steps, self._epsilon_at(self._steps))
        return self._epsilon_cache[1]

    def can_step(self, n: int = 1) -> bool:
        """Whether `n` more steps keep epsilon <= target_epsilon."""
        n = accounting._check_count("n", n)
        return self.target_epsilon is None or self._steps + n <= self.max_steps

    def step(self, n: int = 1) -> None:
        """Records `n` steps; raises RuntimeError if they would exceed the budget."""
        if not self.can_step(n):
            raise RuntimeError(
                f"privacy budget exhausted: {n} more step(s) after {self._steps} would "
                f"spend epsilon = {self._epsilon_at(self._steps + n):.4g} > "
                f"target_epsilon = {self.target_epsilon:g} at delta = {self.delta:g} "
                f"({self.accountant} accountant; the budget allows {self.max_steps} "
                "steps in total). Stop training here.")
        self._steps += n

    def state_dict(self) -> dict[str, Any]:
        """The constructor arguments and the step count, JSON-serialisable."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "sampling_probability": self.sampling_probability,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "accountant": self.accountant,
            "value_discretization_interval": self.value_discretization_interval,
            "steps": self._steps,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BudgetTracker:
        """Rebuilds a tracker from `state_dict()` output."""
        tracker = cls(
            state["noise_multiplier"], state["sampling_probability"], state["delta"],
            target_epsilon=state["target_epsilon"], accountant=state["accountant"],
            value_discretization_interval=state.get(
                "value_discretization_interval", accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL))
        tracker._steps = accounting._check_count("steps", state["steps"])
        return tracker

    def _epsilon_at(self, steps: int) -> float:
        return accounting._epsilon(self.noise_multiplier, self.sampling_probability, steps,
                                   self.delta, self.accountant, self.value_discretization_interval)

    def __repr__(self) -> str:
        return (f"BudgetTracker(noise_multiplier={self.noise_multiplier}, "
                f"sampling_probability={self.sampling_probability}, delta={self.delta}, "
                f"target_epsilon={self.target_epsilon}, accountant={self.accountant!r}, "
                f"steps={self._steps})")
