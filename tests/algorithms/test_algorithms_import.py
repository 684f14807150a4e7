"""`learner.algorithms` must import with only torch: no Ray, DeepSpeed, vLLM or transformers.

Done in-process (a fresh interpreter would spend ~5 s re-importing torch): the package and
any already-loaded heavy modules are dropped from ``sys.modules``, a finder that refuses
the heavy packages goes first on ``sys.meta_path``, and the package is imported again.
``monkeypatch`` puts ``sys.modules`` and ``sys.meta_path`` back afterwards.
"""

import importlib
import sys

BLOCKED = ("ray", "deepspeed", "vllm", "transformers")


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None


def _is_fresh_import_target(name: str) -> bool:
    return name == "learner.algorithms" or name.startswith("learner.algorithms.") or name.split(".")[0] in BLOCKED


def test_imports_with_only_torch(monkeypatch):
    for name in [name for name in sys.modules if _is_fresh_import_target(name)]:
        monkeypatch.delitem(sys.modules, name)
    if "learner" in sys.modules and hasattr(sys.modules["learner"], "algorithms"):
        monkeypatch.setattr(sys.modules["learner"], "algorithms", sys.modules["learner"].algorithms)  # restored after
    monkeypatch.setattr(sys, "meta_path", [_Blocker(), *sys.meta_path])

    algorithms = importlib.import_module("learner.algorithms")

    assert callable(algorithms.ppo_clip_loss)
    assert not [name for name in sys.modules if name.split(".")[0] in BLOCKED]


def test_blocker_really_blocks(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [_Blocker(), *sys.meta_path])
    for name in BLOCKED:
        monkeypatch.delitem(sys.modules, name, raising=False)
        try:
            importlib.import_module(name)
        except ImportError as err:
            assert "blocked" in str(err)
        else:
            raise AssertionError(f"{name} was importable despite the blocker")
