"""The start-up breakdown in summary.json: phases marked in order chain, a phase marked ``since``
another ran beside the chain, the first step counts from the last chained phase."""

from __future__ import annotations

from observe.run_dir import startup_phases


def test_phases_chain_and_side_by_side_phases_count_from_their_start():
    marks = {
        "prepare": (14.0, None),  # began at the command's start, 10.0
        "ray": (20.5, None),
        "learner": (31.0, "ray"),  # started with the actors when Ray was up
        "actors": (40.5, "ray"),
        "processes": (40.5, None),
        "weight_channel": (41.0, None),
    }
    assert startup_phases(10.0, marks, first_step_at=44.2) == {
        "prepare_s": 4.0,
        "ray_s": 6.5,
        "learner_s": 10.5,
        "actors_s": 20.0,
        "processes_s": 20.0,
        "weight_channel_s": 0.5,
        "first_step_s": 3.2,
    }


def test_no_first_step_no_first_step_phase():
    assert startup_phases(0.0, {"prepare": (2.0, None)}, first_step_at=None) == {"prepare_s": 2.0}
