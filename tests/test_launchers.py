"""Cluster launchers without a cluster: the SLURM script (syntax, and run against stub srun/ray/tandem),
the KubeRay RayJob manifest, Ray job submission (unreachable address, log following with a fake client)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from launch.config import load_config
from launch.deploy.k8s import render_rayjob
from launch.deploy.slurm import render_sbatch
from launch.deploy.submit import (
    LaunchError,
    SubmitError,
    follow_job,
    submit,
    train_command,
)

# 2 actors x 1 GPU + 2 learner ranks x 1 GPU = 4 GPUs; 2 x 1 + 2 x 1 = 4 CPUs.
PLAN = [
    "model.path=Qwen/Qwen2.5-0.5B",
    "data.prompts=data.jsonl",
    "reward.function=r.py:f",
    "resources.actors.count=2",
    "resources.actors.num_gpus=1",
    "resources.learner.ranks=2",
    "resources.learner.num_gpus=1",
]
# A space and a command substitution: both must reach tandem as literal single arguments.
OVERRIDES = ["run.name=my run", "run.output_dir=$(touch pwned)"]


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, PLAN)


def sbatch(cfg, **kw) -> str:
    args = dict(
        nodes=3,
        gpus_per_node=2,
        cpus_per_node=4,
        partition="gpu",
        time_limit="1-00:00:00",
        job_name="tandem",
        venv=None,
    )
    return render_sbatch(cfg, "configs/my grpo.yaml", OVERRIDES, **{**args, **kw})


def rayjob(cfg, **kw) -> dict:
    args = dict(
        name="tandem-grpo",
        image="ghcr.io/me/tandem:1",
        namespace="rl",
        worker_replicas=2,
        gpus_per_worker=2,
        cpus_per_worker=8,
        memory_per_worker="64Gi",
        head_cpus=2,
        head_memory="8Gi",
    )
    return yaml.safe_load(render_rayjob(cfg, "configs/grpo.yaml", OVERRIDES, **{**args, **kw}))


# --- SLURM -----------------------------------------------------------------------------------------------


def test_sbatch_is_valid_bash_with_the_allocation_and_the_ray_pattern(cfg, tmp_path):
    script = sbatch(cfg)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, capture_output=True)
    for line in (
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1-00:00:00",
    ):
        assert line in script.splitlines()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert "ray start --head" in script and '--address="$ray_address"' in script
    assert 'for node in "${nodes[@]:1}"' in script  # workers on every node but the head
    assert "deadline=$((SECONDS + 600))" in script and "wait_for_nodes 3" in script
    assert "trap cleanup EXIT" in script
    assert (
        "tandem train --config 'configs/my grpo.yaml' --resume auto \"resources.address=$ray_address\" "
        "'run.name=my run' 'run.output_dir=$(touch pwned)'"
    ) in script


def test_sbatch_without_gpus_has_no_gpu_directive():
    cpu_cfg = load_config(None, PLAN[:3])
    script = render_sbatch(
        cpu_cfg,
        "c.yaml",
        [],
        nodes=1,
        gpus_per_node=0,
        cpus_per_node=2,
        partition=None,
        time_limit="10:00",
        job_name="t",
        venv="/opt/my venv",
    )
    assert "--gpus-per-node" not in script and "--partition" not in script
    assert "source '/opt/my venv/bin/activate'" in script


GCS_WAIT = "RAY_gcs_rpc_server_reconnect_timeout_s=600 RAY_task_events_max_num_task_in_gcs=10000"
HOLD_SIGTERM = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def test_sbatch_starts_ray_with_sigterm_blocked(cfg, tmp_path):
    """scancel signals every process of the job: Ray's (the head's and the workers' `ray start`, and all they
    start) hold SIGTERM blocked, so only tandem train acts on it. The script's own prefix, run for real."""
    script = sbatch(cfg)
    prefix = script[script.index("hold_sigterm=") : script.index("\n", script.index("ray_hold=("))]
    probe = f'{prefix}\n"${{ray_hold[@]}}" grep SigBlk /proc/self/status'
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    blocked = int(done.stdout.split()[-1], 16)
    assert blocked & (1 << (signal.SIGTERM - 1))


def _stubs(tmp_path: Path, nodes_up: int, tandem_rc: int) -> dict[str, str]:
    """Fake scontrol/srun/ray/python3/tandem on PATH that log what the script asks of them. HOME is a folder
    of the test's: the script writes the cluster's Ray token there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "scontrol": "printf 'n1\\nn2\\nn3\\n'",
        "srun": 'echo "srun $*" >> "$LOG"; [[ " $* " == *" hostname "* ]] && echo "10.0.0.1 fe80::1"; exit 0',
        "ray": 'echo "ray $*" >> "$LOG"',
        "python3": f"echo {nodes_up}",  # the node count the wait loop polls
        "tandem": f'echo "tandem" >> "$LOG"; printf "%s\\n" "$@" > "$ARGS"; exit {tandem_rc}',
        "sleep": "exit 0",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        "LOG": str(tmp_path / "log"),
        "ARGS": str(tmp_path / "args"),
        "SLURM_JOB_NODELIST": "n[1-3]",
    }


def test_sbatch_runs_head_workers_then_train_and_stops_ray(cfg, tmp_path):
    (tmp_path / "job.sbatch").write_text(sbatch(cfg))
    env = _stubs(tmp_path, nodes_up=3, tandem_rc=3)
    done = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 3, done.stderr  # tandem's exit status is the job's
    auth = f"env -u RAY_AUTH_TOKEN RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={tmp_path}/home/.ray/auth_token"
    auth += f" {GCS_WAIT} python3 -c {HOLD_SIGTERM}"  # a dead GCS server's wait; SIGTERM blocked
    expected = [
        f"srun --nodes=1 --ntasks=1 --cpus-per-task=4 --gpus-per-node=2 -w n1 {auth} ray start --head "
        "--node-ip-address=10.0.0.1 --port=6379 --num-cpus=4 --num-gpus=2 --dashboard-host=127.0.0.1 --block"
    ] + [
        f"srun --nodes=1 --ntasks=1 --cpus-per-task=4 --gpus-per-node=2 -w {worker} {auth} ray start "
        "--address=10.0.0.1:6379 --num-cpus=4 --num-gpus=2 --block"
        for worker in ("n2", "n3")
    ]
    # the head and workers run in the background: their stubs may log after the script ends
    deadline = time.monotonic() + 10
    while not set(expected) <= set(log := (tmp_path / "log").read_text().splitlines()):
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
    assert log.index("ray stop --force") > log.index("tandem")  # the EXIT trap, after training
    args = (tmp_path / "args").read_text().splitlines()
    assert args == [
        "train", "--config", "configs/my grpo.yaml", "--resume", "auto", "resources.address=10.0.0.1:6379", *OVERRIDES
    ]  # fmt: skip
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("gpus", [0, 2])
def test_every_ray_start_step_asks_for_the_nodes_cpus_and_gpus_itself(cfg, gpus):
    """Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: a step without it gets one core."""
    if not gpus:  # a CPU cluster
        cfg = load_config(None, ["model.path=m", "data.prompts=builtin:successor", "reward.function=builtin:successor"])
    script = render_sbatch(cfg, "c.yaml", [], nodes=3, gpus_per_node=gpus, cpus_per_node=16, partition=None,
                           time_limit="1:00:00", job_name="t", venv=None)  # fmt: skip
    lines = script.replace("\\\n", " ").splitlines()  # a continued command on one line
    steps = [line for line in lines if line.strip().startswith("srun") and "ray start" in line]
    assert len(steps) == 2 and all("--cpus-per-task=16" in line for line in steps)  # the head's and the workers'
    assert all(("--gpus-per-node=2" in line) == bool(gpus) for line in steps)


def test_sbatch_passes_slurms_sigterm_to_tandem_train_and_exits_with_its_status(cfg, tmp_path):
    script = sbatch(cfg, signal_s=240)
    assert "#SBATCH --signal=B:TERM@240" in script  # SLURM warns the batch script 4 minutes before --time
    (tmp_path / "job.sbatch").write_text(script)
    env = _stubs(tmp_path, nodes_up=3, tandem_rc=0)
    # a tandem that takes a while to stop on SIGTERM, as a real run finishing its step does
    (tmp_path / "bin" / "tandem").write_text(
        '#!/bin/bash\ntrap \'sleep 0.5; echo TERM >> "$LOG"; exit 143\' TERM\nprintf "%s\\n" "$@" > "$ARGS"\n'
        "while true; do /bin/sleep 0.05; done\n"
    )
    job = subprocess.Popen(["bash", "job.sbatch"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "args").exists():
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=20)
    assert job.returncode == 143, out  # the job ends with tandem's status, after tandem stopped
    assert "TERM" in (tmp_path / "log").read_text().splitlines()
    assert "tandem-slurm: SIGTERM: tandem train checkpoints and stops" in out
    assert "tandem train exited with 143" in out


def test_the_stop_signal_must_come_before_the_time_limit(cfg):
    from launch.deploy.slurm import slurm_seconds

    assert [slurm_seconds(t) for t in ("30", "30:15", "2:00:00", "1-12", "1-12:30", "1-00:00:00")] == [
        1800, 1815, 7200, 129600, 131400, 86400,
    ]  # fmt: skip
    assert slurm_seconds("UNLIMITED") is None
    with pytest.raises(LaunchError, match=r"--signal-s 300 is not less than --time 00:05:00 \(300 s\)"):
        sbatch(cfg, time_limit="00:05:00")
    assert "--signal=B:TERM@60" in sbatch(cfg, time_limit="00:05:00", signal_s=60)


def test_sbatch_gives_up_at_the_deadline_with_a_clear_error(cfg, tmp_path):
    (tmp_path / "job.sbatch").write_text(sbatch(cfg, wait_s=0))
    env = _stubs(tmp_path, nodes_up=1, tandem_rc=0)  # the head comes up, the workers never do
    done = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "error: only 1 of 3 Ray nodes joined 10.0.0.1:6379 within 0 s" in done.stderr
    assert not (tmp_path / "args").exists()  # training never started
    assert (tmp_path / "log").read_text().splitlines()[-1] == "ray stop --force"


def test_sbatch_refuses_an_allocation_too_small(cfg):
    with pytest.raises(ValueError) as err:
        sbatch(cfg, nodes=1, gpus_per_node=2)  # 4 GPUs asked, 1 x 2 = 2
    message = str(err.value)
    assert "needs 4 GPUs (2 actors x 1 + 2 learner ranks x 1) but 1 nodes x 2 GPUs = 2" in message
    assert "raise --nodes" in message and "\n" not in message
    with pytest.raises(ValueError, match="needs 4 CPUs .* but 3 nodes x 1 CPUs = 3"):
        sbatch(cfg, cpus_per_node=1)
    big_rank = load_config(None, PLAN + ["resources.learner.num_gpus=4"])
    with pytest.raises(ValueError, match="one learner rank asks for 4 GPUs but each of the nodes has 2"):
        sbatch(big_rank, nodes=8)  # 10 GPUs fit in 16, but no node holds a 4-GPU rank


def test_sbatch_refuses_values_sbatch_would_misread(cfg):
    with pytest.raises(LaunchError, match="--job-name"):
        sbatch(cfg, job_name="x\n#SBATCH --nodes=99")
    with pytest.raises(LaunchError, match="resources.address is set by the launcher"):
        render_sbatch(
            cfg,
            "c.yaml",
            ["resources.address=h:1"],
            nodes=3,
            gpus_per_node=2,
            cpus_per_node=4,
            partition=None,
            time_limit="1:00:00",
            job_name="t",
            venv=None,
        )


def test_sbatch_asks_to_be_requeued_and_trains_with_resume_auto(cfg):
    script = sbatch(cfg).splitlines()
    # a requeued job runs the script again: its output is appended to the earlier start's, and tandem
    # train --resume auto continues the run that start began
    assert "#SBATCH --requeue" in script and "#SBATCH --open-mode=append" in script
    assert any(line.startswith("tandem train --config ") and " --resume auto " in line for line in script)
    no_requeue = sbatch(cfg, requeue=False).splitlines()
    assert "#SBATCH --requeue" not in no_requeue and "#SBATCH --open-mode=append" not in no_requeue
    assert any(" --resume auto " in line for line in no_requeue)  # submitting it again still continues


def _token_env_stub(tmp_path: Path) -> None:
    """A tandem stub that writes the Ray variables it was started with to $ARGS."""
    (tmp_path / "bin" / "tandem").write_text(
        '#!/bin/bash\nfor v in RAY_AUTH_MODE RAY_AUTH_TOKEN_PATH RAY_AUTH_TOKEN; do echo "$v=${!v-unset}"; done '
        '> "$ARGS"\n'
    )


def test_the_sbatch_cluster_requires_a_private_token_and_keeps_the_dashboard_on_loopback(cfg, tmp_path):
    (tmp_path / "job.sbatch").write_text(sbatch(cfg))
    env = _stubs(tmp_path, nodes_up=3, tandem_rc=0)
    _token_env_stub(tmp_path)
    env["RAY_AUTH_TOKEN"] = "from-the-login-shell"  # never reaches the cluster: one token, the file's
    done = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    token = tmp_path / "home" / ".ray" / "auth_token"
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text())  # 256 random bits, as `ray get-auth-token --generate`
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    # the driver (tandem train) runs with token auth and the file's token
    assert (tmp_path / "args").read_text().splitlines() == [
        "RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={token}", "RAY_AUTH_TOKEN=unset"
    ]  # fmt: skip
    deadline = time.monotonic() + 10  # the head and workers run in the background
    while len(starts := [line for line in (tmp_path / "log").read_text().splitlines() if "ray start" in line]) < 3:
        assert time.monotonic() < deadline, starts
        time.sleep(0.05)
    auth = f" env -u RAY_AUTH_TOKEN RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token}"
    auth += f" {GCS_WAIT} python3 -c {HOLD_SIGTERM} ray start "
    assert all(auth in line for line in starts)  # the head and every worker
    (head,) = [line for line in starts if "--head" in line]
    assert "--dashboard-host=127.0.0.1" in head

    # a token that exists is kept (clusters of other jobs use it) and made private
    token.write_text("b" * 64)
    token.chmod(0o644)
    done = subprocess.run(["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert token.read_text() == "b" * 64 and stat.S_IMODE(token.stat().st_mode) == 0o600


# --- Kubernetes --------------------------------------------------------------------------------------------


def test_rayjob_manifest(cfg):
    job = rayjob(cfg, workdir="/app", env={"HF_HOME": "/cache/hf"})
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["metadata"]["name"] == "tandem-grpo" and job["metadata"]["namespace"] == "rl"
    spec = job["spec"]
    assert spec["entrypoint"] == (
        "cd /app && tandem train --config configs/grpo.yaml --resume auto resources.address=auto "
        "'run.name=my run' 'run.output_dir=$(touch pwned)'"
    )
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"env_vars": {"HF_HOME": "/cache/hf"}}
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # nothing of the plan lands on the head
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    [workers] = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 2
    worker = workers["template"]["spec"]["containers"][0]
    assert worker["image"] == "ghcr.io/me/tandem:1"
    for side in ("requests", "limits"):
        assert worker["resources"][side] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}


def test_rayjob_cpu_workers_ask_for_no_gpus():
    cpu_cfg = load_config(None, PLAN[:3])
    job = yaml.safe_load(
        render_rayjob(
            cpu_cfg,
            "c.yaml",
            [],
            name="t",
            image="i",
            namespace=None,
            worker_replicas=1,
            gpus_per_worker=0,
            cpus_per_worker=2,
            memory_per_worker="4Gi",
            head_cpus=1,
            head_memory="2Gi",
        )
    )
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in worker["resources"]["limits"]
    assert "namespace" not in job["metadata"] and "runtimeEnvYAML" not in job["spec"]


def test_rayjob_refuses_too_few_workers_and_bad_names(cfg):
    with pytest.raises(ValueError, match="needs 4 GPUs .* but 1 worker pods x 2 GPUs = 2; raise --workers"):
        rayjob(cfg, worker_replicas=1)
    with pytest.raises(LaunchError, match="--name"):
        rayjob(cfg, name="Tandem_GRPO")
    with pytest.raises(LaunchError, match="Kubernetes quantity"):
        rayjob(cfg, memory_per_worker="64 GB")


def _containers(job: dict) -> list[dict]:
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["spec"]["containers"]]


def test_rayjob_cluster_requires_the_token(cfg):
    job = rayjob(cfg)
    cluster = job["spec"]["rayClusterSpec"]
    # KubeRay >= 1.5.1 keeps the token in a Secret it makes and gives it to every Ray container, the
    # submitter and its own dashboard client; no token of ours is written into the manifest
    assert cluster["authOptions"] == {"mode": "token"}
    assert "RAY_AUTH_TOKEN" not in str(job)
    for container in _containers(job):  # token mode set by us too: a pod never runs Ray without it
        assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"]
    # the operator polls the job and the submitter pod submits it through the head's Service: the dashboard
    # must listen on the pod's address (behind the token), not on loopback
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert rayjob(cfg, token_secret="my-ray-token")["spec"]["rayClusterSpec"]["authOptions"] == {
        "mode": "token", "secretName": "my-ray-token"
    }  # fmt: skip
    with pytest.raises(LaunchError, match="--token-secret"):
        rayjob(cfg, token_secret="My_Token")


def test_rayjob_retries_with_resume_auto_on_the_runs_volume(cfg):
    job = rayjob(cfg, retries=3, runs_pvc="tandem-runs", workdir="/app")
    assert job["spec"]["backoffLimit"] == 3 and rayjob(cfg)["spec"]["backoffLimit"] == 2
    assert " --resume auto " in job["spec"]["entrypoint"]  # every retry runs this same command
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:  # the driver writes the run directory, every learner rank its checkpoint part
        assert {"name": "runs", "persistentVolumeClaim": {"claimName": "tandem-runs"}} in pod["spec"]["volumes"]
    for container in _containers(job):  # the config's run.output_dir, runs, taken under --workdir
        assert {"name": "runs", "mountPath": "/app/runs"} in container["volumeMounts"]
    with pytest.raises(LaunchError, match="set run.output_dir to an absolute path"):
        rayjob(cfg, runs_pvc="tandem-runs")  # a relative run.output_dir and no --workdir: no path to mount at
    absolute = load_config(None, [*PLAN, "run.output_dir=/shared/runs"])
    job = yaml.safe_load(render_rayjob(absolute, "c.yaml", [], name="t", image="i", namespace=None, worker_replicas=2,
                         gpus_per_worker=2, cpus_per_worker=8, memory_per_worker="8Gi", head_cpus=1,
                         head_memory="2Gi", runs_pvc="tandem-runs"))  # fmt: skip
    assert all({"name": "runs", "mountPath": "/shared/runs"} in c["volumeMounts"] for c in _containers(job))
    assert all(len(c["volumeMounts"]) == 1 for c in _containers(rayjob(cfg)))  # /dev/shm only without a claim


# --- Ray job submission ---------------------------------------------------------------------------------------


def test_train_command_quotes_every_user_value():
    assert train_command("a b.yaml", ["x=1", "y=$HOME"], None) == "tandem train --config 'a b.yaml' x=1 'y=$HOME'"


def test_submit_to_an_unreachable_address_fails_fast(tmp_path, monkeypatch):
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "g.yaml").write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"prompts": "d.jsonl"},
                                                      "reward": {"function": "builtin:successor"}}))  # fmt: skip
    started = time.monotonic()
    with pytest.raises(SubmitError) as err:
        submit("http://127.0.0.1:1", str(tmp_path / "g.yaml"), [], working_dir=str(tmp_path))
    assert time.monotonic() - started < 5
    message = str(err.value)
    assert "no Ray job server at http://127.0.0.1:1" in message and "ray start --head" in message
    assert "\n" not in message


class FakeJobs:
    """The three JobSubmissionClient calls follow_job makes; logs arrive in chunks, then the job ends."""

    def __init__(self, chunks: list[str], statuses: list[str], hang: bool = False):
        self.chunks, self.statuses, self.hang, self.stopped = chunks, statuses, hang, []

    async def tail_job_logs(self, job_id):
        for chunk in self.chunks:
            yield chunk
        if self.hang:
            await asyncio.sleep(60)

    def get_job_status(self, job_id):
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def stop_job(self, job_id):
        self.stopped.append(job_id)


def test_follow_streams_logs_and_returns_the_final_status(capsys):
    jobs = FakeJobs(["step 1\n", "step 2\n"], ["FAILED"])
    assert follow_job(jobs, "raysubmit_1", timeout_s=None) == "FAILED"
    assert capsys.readouterr().out == "step 1\nstep 2\n"


def test_follow_stops_the_job_at_the_deadline():
    jobs = FakeJobs(["step 1\n"], ["RUNNING"], hang=True)
    started = time.monotonic()
    with pytest.raises(SubmitError, match="raysubmit_2 still running after 0.2s"):
        follow_job(jobs, "raysubmit_2", timeout_s=0.2)
    assert time.monotonic() - started < 2 and jobs.stopped == ["raysubmit_2"]
