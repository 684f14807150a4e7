"""The prompt ledger: which prompt of the data order is where, so that each is trained once.

A prompt id is the prompt's position in the data order (``queues/prompts.py``: seeded epochs of
the rows), so the id alone says which row it is, in this run and in a resumed one.

    admitted ──▶ outstanding ──trained──▶ gone
                     │  ▲
       dropped stale, │  │ generated again
       actor died,    ▼  │
       resumed ──▶ to regenerate

``outstanding`` holds every admitted prompt not yet trained on: in the prompt queue, inside an
actor, in the results queue, or waiting to be generated again. A checkpoint stores the next new
id and the outstanding ids; a resumed run generates those again first, so nothing admitted is
lost and nothing trained is trained twice (a group whose prompt is no longer outstanding, e.g. a
dead actor's result that arrived after its prompts were handed out again, is a duplicate and is
ignored).
"""

from __future__ import annotations

import collections
from typing import Any

from queues.prompts import PromptStream


class PromptLedger:
    def __init__(self, stream: PromptStream, next_id: int = 0, pending: list[int] | None = None):
        self.stream = stream
        self.next_id = next_id
        self.outstanding: set[int] = set(pending or ())
        self.regenerate: collections.deque[int] = collections.deque(sorted(pending or ()))
        self.duplicates = 0  # groups ignored because their prompt was already trained

    def take(self) -> tuple[int, dict[str, Any]]:
        """The next prompt to hand out: one to generate again first, else the next new one."""
        while self.regenerate:
            prompt_id = self.regenerate.popleft()
            if prompt_id in self.outstanding:  # not trained meanwhile (a late result of the first try)
                return prompt_id, self.stream.row(prompt_id)
        prompt_id = self.next_id
        self.next_id += 1
        self.outstanding.add(prompt_id)
        return prompt_id, self.stream.row(prompt_id)

    def again(self, prompt_ids) -> None:
        """These outstanding prompts must be generated again (dropped as stale, or their actor died)."""
        for prompt_id in sorted(prompt_ids):
            if prompt_id in self.outstanding and prompt_id not in self.regenerate:
                self.regenerate.append(prompt_id)

    def trained(self, prompt_id: int) -> bool:
        """Record that a group of ``prompt_id`` is trained on; False if it is a duplicate."""
        if prompt_id not in self.outstanding:
            self.duplicates += 1
            return False
        self.outstanding.discard(prompt_id)
        return True

    def is_outstanding(self, prompt_id: int) -> bool:
        return prompt_id in self.outstanding

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores: the data order's seed, the next new id, what is outstanding."""
        return {
            "seed": self.stream.seed,
            "shuffle": self.stream.shuffle,
            "rows": len(self.stream.rows),
            "next_id": self.next_id,
            "pending": sorted(self.outstanding),
        }

    @classmethod
    def restore(cls, stream: PromptStream, state: dict[str, Any]) -> PromptLedger:
        return cls(stream, next_id=int(state["next_id"]), pending=[int(i) for i in state["pending"]])
