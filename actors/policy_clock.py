"""Which policy version an actor's engine holds, and how long the actor spent on weights.

Both actor kinds keep one: the sync actor loads weights between generate calls, the
in-flight actor mid-generation. Weight time is reported twice: in total (``stats``) and
since the last group pushed to the results queue (``take_wait``), which rides on the next
group to the learner's step metrics (``actor_weight_wait_s``).
"""

from __future__ import annotations


class PolicyClock:
    def __init__(self):
        self.version = 0  # policy version of the weights now loaded (0: the initial weights)
        self.loads = 0
        self.wait_s = 0.0  # total time spent waiting for / loading weights
        self._unreported_s = 0.0

    def wants(self, latest: int, min_version: int) -> bool:
        """Whether to fetch: something newer is published, or the next request needs newer weights."""
        return latest > self.version or min_version > self.version

    def loaded(self, version: int) -> None:
        self.version = version
        self.loads += 1

    def waited(self, seconds: float) -> None:
        self.wait_s += seconds
        self._unreported_s += seconds

    def take_wait(self) -> float:
        """Weight time since the last call (reported with the next pushed group)."""
        wait, self._unreported_s = self._unreported_s, 0.0
        return wait

    def stats(self) -> dict[str, float]:
        return {"version": self.version, "weight_loads": self.loads, "weight_wait_s": self.wait_s}
