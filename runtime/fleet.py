"""An elastic generation fleet: actors join and leave a running job.

Generation is most of a run's compute, and it is what spot nodes and the Ray autoscaler add and take
away. ``tandem scale RUN_DIR --actors N`` writes ``RUN_DIR/fleet.json``; the driver reads it every
``FLEET_EVERY_S`` (``FleetWatch``) and the actor pool (``runtime/supervise.py``) grows or shrinks to N:

- an actor that joins asks Ray for its own resources (outside the run's placement group, which keeps
  the actors it started with): Ray starts it on any node with room, one that joined the cluster after
  the run started included, or, when none has room yet, once one does (within ``run.startup_timeout_s``);
  it loads the newest weights before it generates, as a replacement does;
- an actor that leaves is stopped, and the prompts it held are generated again by the others, each
  exactly once (the prompt ledger drops a late duplicate). The newest actors leave first;
- an actor that joined this way and dies where no node has room for a new one leaves the fleet instead
  of stopping the run (the actors the run started with keep their placement bundles: Ray places those
  again when their node is lost).
Admission does not count actors: prompts go out by ``run.max_staleness`` into one queue, and every actor
takes from it, so a larger fleet drains it sooner. The fleet's size is said on the console and in
driver.log; the weight channel must take new members (``weights.backend: ray``; the distributed one
is one process group) and the schedule must be ``overlapped`` (colocated actors live on the learner's
devices).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

FLEET_FILE = "fleet.json"
FLEET_EVERY_S = 2.0


class FleetError(ValueError):
    """A fleet size that cannot be asked for (the message names why)."""


def request_size(root: Path, actors: int) -> Path:
    """Ask the run in ``root`` for ``actors`` generation actors (``tandem scale``); the file it wrote."""
    if actors < 1:
        raise FleetError(f"--actors {actors}: a run needs at least one generation actor")
    if not (root / "config.yaml").is_file():
        raise FleetError(f"{root}: not a run directory (no config.yaml); give the RUN_DIR a run printed")
    path = root / FLEET_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"actors": actors, "asked_at": time.strftime("%Y-%m-%d %H:%M:%S")}))
    os.replace(partial, path)  # the driver never reads half a file
    return path


def requested_size(root: Path) -> int | None:
    """The size last asked for in ``root``, or None (nothing asked, or a file that does not read)."""
    try:
        actors = json.loads((root / FLEET_FILE).read_text())["actors"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return actors if isinstance(actors, int) and actors >= 1 else None


class FleetWatch:
    """Reads ``RUN_DIR/fleet.json`` every ``every_s`` and has the pool take each new size (``resize``). A
    request from before this start of the run (a resumed run's) is not taken again: the run starts with
    its config's count."""

    def __init__(self, root: Path, resize, say: Callable[[str], None], refused: str | None, every_s=FLEET_EVERY_S):
        self.root, self.resize, self.say, self.refused, self.every_s = root, resize, say, refused, every_s
        self.stamp = self._stamp()

    def _stamp(self) -> float | None:
        try:
            return (self.root / FLEET_FILE).stat().st_mtime_ns
        except OSError:
            return None

    async def watch(self) -> None:
        """Until cancelled."""
        while True:
            await asyncio.sleep(self.every_s)
            stamp = self._stamp()
            if stamp == self.stamp or stamp is None:
                continue
            self.stamp = stamp
            size = requested_size(self.root)
            if size is None:
                self.say(f'tandem scale: {self.root / FLEET_FILE} does not read as {{"actors": N}}; ignored')
            elif self.refused:
                self.say(f"tandem scale: the fleet cannot change: {self.refused}")
            else:
                await self.resize(size)
