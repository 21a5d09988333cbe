"""Slurm: job-id logger versions and requeue-resume in the CLI, W&B offline tracking, the chain and sweep scripts,
and — on a real single-node cluster started here — the feedback array job, SIGUSR1 requeue, and a sweep array."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from persrag_lightning.cli import main
from tests.helpers.slurm_cluster import SlurmCluster, missing_binaries, start_cluster
from tests.training.test_ddp import SYNTH, feedback_world

REPO = Path(__file__).resolve().parents[2]
TINY_FIT = ("--data.init_args.synth.num_users=32", "--data.init_args.batch_size=8", "--trainer.accelerator=cpu",
            "--model.init_args.config.dropout=0", "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
            "--trainer.enable_model_summary=false")


def fit_args(encoder: str, run: str, epochs: int, *extra: str) -> list[str]:
    return ["fit", "--config", "cfrag_user_encoder.yaml", "--run_name", run, f"--data.init_args.encoder={encoder}",
            f"--trainer.max_epochs={epochs}", *TINY_FIT, *extra]


def read_csv_rows(path: Path) -> list[str]:
    return path.read_text().splitlines()[1:]


# ---- the CLI under a (simulated) Slurm job: no cluster needed ------------------------------------------------------

@pytest.fixture()
def in_slurm_job(monkeypatch):
    """The variables a Slurm array task sees (without SLURM_NTASKS Lightning does not switch to SLURMEnvironment)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")


def test_requeued_job_resumes_its_own_run(in_tmp_cwd, tiny_bert, in_slurm_job, capsys):
    """The CSV version is slurm-<array job>_<task>; starting the same job again (a requeue killed without SIGUSR1)
    resumes from that version's last.ckpt, trains only the missing epoch, and keeps the first attempt's CSV."""
    main(fit_args(tiny_bert, "t", 1))
    job_dir = in_tmp_cwd / "runs" / "t" / "user_encoder" / "logs" / "slurm-4240_3"
    first = read_csv_rows(job_dir / "metrics.csv")
    assert (job_dir / "checkpoints" / "last.ckpt").exists()

    main(fit_args(tiny_bert, "t", 2))
    assert f"resuming from {Path('runs/t/user_encoder/logs/slurm-4240_3/checkpoints/last.ckpt')}" in \
        capsys.readouterr().err
    assert read_csv_rows(job_dir / "metrics.0.csv") == first
    resumed = read_csv_rows(job_dir / "metrics.csv")
    assert {row.split(",")[0] for row in resumed if row.split(",")[2]} == {"1"}  # trained epoch 1 only
    last = torch.load(job_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["epoch"] == 1 and last["global_step"] == 8
    assert [p.name for p in (in_tmp_cwd / "runs" / "t" / "user_encoder" / "logs").iterdir()] == ["slurm-4240_3"]


def wandb_records(run_file: Path):
    """The protobuf Records of an offline .wandb file (a LevelDB-style log: 7-byte file header, 32 KiB blocks,
    chunks with a 7-byte header crc32/length/type), read without network or wandb's Go core."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, block = run_file.read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B", run_file
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a record still being written
            return
        if kind == 0:
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def test_wandb_offline_logs_config_metrics_and_export(in_tmp_cwd, tiny_bert, in_slurm_job, monkeypatch):
    """configs/wandb.yaml composes with a stage config; offline, the run (id from the job id) holds the whole CLI
    config, the logged metrics and the exported bundle's path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    main(fit_args(tiny_bert, "w", 1, "--config", "wandb.yaml"))
    import wandb

    wandb.finish()  # flush the offline run (a CLI process does this at exit)
    runs = list((in_tmp_cwd / "runs" / "w" / "user_encoder" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].name == "run-w-user_encoder-slurm-4240_3.wandb"
    deadline = time.monotonic() + 60  # wandb's core process may still be writing after wandb.finish() returns
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(runs[0])):
        assert time.monotonic() < deadline, f"{runs[0]} has no exit record"
        time.sleep(0.5)
    config, metrics, summary, run = {}, set(), {}, None
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            metrics |= {"/".join(i.nested_key) or i.key for i in record.history.item}
        elif kind == "summary":
            summary.update({u.key: json.loads(u.value_json) for u in record.summary.update if u.key})
    assert run.display_name == "w/user_encoder" and run.project == "persrag"
    assert config["cli"]["run_name"] == "w" and config["cli"]["trainer"]["max_epochs"] == 1
    assert config["training"]["temperature"] == 0.1  # the module's hyper-parameters, as Lightning logs them
    assert {"train/loss", "val/loss", "val/view_acc"} <= metrics
    assert summary["export_path"] == str(in_tmp_cwd / "checkpoints" / "w" / "user_encoder")


# ---- scripts that need no cluster -----------------------------------------------------------------------------------

def test_submit_chain_wires_afterok_dependencies(tmp_path):
    """The chain submits 5 jobs, each with afterok on the one before; arrays for the feedback shards."""
    log = tmp_path / "sbatch.log"
    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/bash\necho \"$*\" >> {log}\necho $(( $(wc -l < {log}) + 100 ))\n")
    fake.chmod(0o755)
    env = {**os.environ, "SBATCH": str(fake), "SHARDS": "3", "STAGE2_ARGS": "--data.init_args.candidates.m=4"}
    out = subprocess.run(["bash", str(REPO / "slurm" / "submit_chain.sh"), "--run_name", "x"], env=env,
                         capture_output=True, text=True, check=True, timeout=30).stdout
    calls = log.read_text().splitlines()
    assert len(calls) == 5 and out.splitlines()[-1].endswith("job 105")
    assert "--dependency" not in calls[0] and "train.sbatch cfrag_user_encoder.yaml --run_name x" in calls[0]
    for i, call in enumerate(calls[1:], start=1):
        assert f"--dependency=afterok:{100 + i}" in call
    assert "--array=0-2" in calls[1] and "feedback_array.sbatch cfrag_retriever.yaml" in calls[1]
    assert calls[2].endswith("train.sbatch cfrag_retriever.yaml --run_name x --data.init_args.candidates.m=4")
    assert "--array=0-2" in calls[3] and "feedback_array.sbatch cfrag_reranker.yaml" in calls[3]


def test_sweep_grid_gives_each_point_its_own_run(tmp_path):
    sweep = tmp_path / "tau.yaml"
    sweep.write_text(yaml.safe_dump({"config": "cfrag_user_encoder.yaml", "args": ["--trainer.max_epochs=2"],
                                     "grid": {"model.init_args.training.temperature": [0.01, 0.1, 1],
                                              "data.init_args.augment.crop_ratio": [0.5, 0.7]}},
                                    sort_keys=False))
    subprocess.run([sys.executable, str(REPO / "slurm" / "sweep.py"), "grid", str(sweep), "--out-root",
                    str(tmp_path / "sweeps")], check=True, capture_output=True, timeout=60)
    lines = (tmp_path / "sweeps" / "tau" / "tasks.txt").read_text().splitlines()
    assert len(lines) == 6 and len({line.split()[4] for line in lines}) == 6  # --run_name tau-<i>
    assert lines[5] == ("fit --config cfrag_user_encoder.yaml --run_name tau-5 --trainer.max_epochs=2 "
                        "--model.init_args.training.temperature=1 --data.init_args.augment.crop_ratio=0.7")


# ---- a real single-node Slurm cluster -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def slurm() -> SlurmCluster:
    """munged + slurmctld + slurmd for this node, started once per session and stopped at its end."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}); `bash .ci/install_slurm.sh` installs "
                    "slurm-wlm and munge where apt-get and root are available")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs slurmctld/slurmd/munged as root (SlurmUser=root); run pytest as root")
    cluster = start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture()
def checkout(tmp_path) -> Path:
    """A folder laid out like the repository root (train.py, configs/): the sbatch scripts cd to the submit dir."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copy(REPO / "train.py", tmp_path / "train.py")
    return tmp_path


def job_env() -> dict[str, str]:
    """The venv's interpreter, and the repository on the path for tests.helpers.slurm_cluster.PauseForSignal."""
    return {"PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def job_output(checkout: Path, pattern: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(checkout.glob(pattern)))


def assert_completed(jobs: list[dict[str, str]], checkout: Path) -> None:
    bad = [j for j in jobs if j["JobState"] != "COMPLETED"]
    assert not bad, f"{bad}\n{job_output(checkout, 'slurm-*.out')[-6000:]}"


def feedback_config(root: Path, tiny_bert: str, tiny_llm: str) -> Path:
    """Stage 1's outputs that feedback needs, in two caches, and the config of a feedback job. The corpus
    embeddings are built before the array starts (as stage 1's fit does in the chain), so that concurrent
    tasks never embed the same corpus at once."""
    feedback_world(root, tiny_bert, caches=("cache_single", "cache_array"))
    config = root / "feedback.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"class_path": "persrag_lightning.modules.retriever.RetrieverModule"},
        "data": {"class_path": "persrag_lightning.datamodules.feedback.FeedbackDataModule", "init_args": {
            "synth": SYNTH,
            "candidates": {"user_encoder": str(root / "user_encoder"), "retriever": tiny_bert, "m": 3, "k": 2},
            "feedback": {"llm": {"model": tiny_llm, "batch_size": 8, "options": {"device": "cpu"}},
                         "chunk_size": 8}}}}))
    return config


def chunks(cache: Path) -> dict[str, list[dict]]:
    """Each chunk's records, with every candidate list in corpus-row order (KL over candidates ignores order)."""
    out = {}
    for p in sorted(cache.rglob("chunk-*.jsonl")):
        records = [json.loads(line) for line in p.read_text().splitlines()]
        for r in records:
            r["candidates"] = sorted(r["candidates"], key=lambda c: c["row"])
        out[str(p.relative_to(cache))] = records
    return out


def assert_same_labels(got: object, want: object, where: str = "") -> None:
    """Equal records; scores equal to float32 rounding. A float32 GEMM's sum order follows the thread split and
    the CPU's kernels, so two processes can differ in the 7th digit of a cosine (CI on 2026-11-28 saw 7e-7)."""
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), where
    elif isinstance(want, dict) and isinstance(got, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same_labels(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_labels(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_feedback_array_job_merges_to_single_process_labels(slurm, checkout, tiny_bert, tiny_llm):
    """3 array tasks (SLURM_ARRAY_TASK_ID → --shard) build 6 chunks; their union holds the labels of one
    `persrag feedback` process: the same examples, candidates, outputs and labels, scores to float32 rounding.
    Every process runs torch on one thread, as `--cpus-per-task=1` means."""
    config = feedback_config(checkout, tiny_bert, tiny_llm)
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    job = slurm.sbatch("--array=0-2", "--cpus-per-task=1", str(REPO / "slurm" / "feedback_array.sbatch"),
                       str(config), "--data.init_args.cache_dir=cache_array", cwd=checkout,
                       env={**job_env(), **one_thread})
    single = subprocess.run([sys.executable, "train.py", "feedback", "--config", str(config),
                             "--data.init_args.cache_dir=cache_single"], cwd=checkout, capture_output=True,
                            text=True, timeout=600, check=False,
                            env={**{k: v for k, v in slurm.env.items() if k != "SLURM_CONF"}, **one_thread})
    assert single.returncode == 0, single.stderr[-4000:]
    tasks = slurm.wait(job, timeout=600)
    assert_completed(tasks, checkout)
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1", "2"]
    logs = job_output(checkout, f"slurm-persrag-feedback-{job}_*.out")
    assert all(f"shard {i}/3" in logs for i in range(3))
    built, want = chunks(checkout / "cache_array"), chunks(checkout / "cache_single")
    assert len(built) == 6 and built.keys() == want.keys()
    assert_same_labels(built, want)


def test_sigusr1_requeues_and_resumes_to_the_uninterrupted_result(slurm, checkout, tiny_bert, monkeypatch):
    """SIGUSR1 (as `--signal=SIGUSR1@90` sends it) at the end of epoch 1: Lightning saves hpc_ckpt_1.ckpt into the
    job's run folder and requeues; the requeued job (same id, same logger version) resumes from it and ends
    bitwise equal to an uninterrupted job: weights and Adam state of last.ckpt, every logged metric, the export.
    DDP with one process (strategy=ddp) so the sampler's order depends only on (seed, epoch); dropout 0."""
    from persrag_lightning.data.synth import SynthConfig
    from persrag_lightning.datamodules.user_history import UserHistoryDataModule

    monkeypatch.chdir(checkout)  # data and embeddings cached before the two jobs start (they would race)
    UserHistoryDataModule(synth=SynthConfig(num_users=32), encoder=tiny_bert).prepare_data()
    args = [f"--data.init_args.encoder={tiny_bert}", "--trainer.max_epochs=3", "--trainer.strategy=ddp", *TINY_FIT]
    marker = checkout / "paused"
    pause = json.dumps({"class_path": "tests.helpers.slurm_cluster.PauseForSignal",
                        "init_args": {"marker": str(marker), "epoch": 1}})
    script = str(REPO / "slurm" / "train.sbatch")
    ref = slurm.sbatch("--cpus-per-task=1", script, "cfrag_user_encoder.yaml", "--run_name", "ref", *args,
                       cwd=checkout, env=job_env())
    job = slurm.sbatch("--cpus-per-task=1", script, "cfrag_user_encoder.yaml", "--run_name", "req", *args,
                       f"--trainer.callbacks+={pause}", cwd=checkout, env=job_env())
    slurm.wait(job, timeout=300, until=lambda jobs: marker.exists() or jobs[0]["JobState"] in ("COMPLETED", "FAILED"))
    assert marker.exists(), job_output(checkout, f"slurm-persrag-train-{job}.out")[-4000:]
    slurm.command("scancel", "--signal=USR1", job)
    assert_completed(slurm.wait(job, timeout=300), checkout)
    assert_completed(slurm.wait(ref, timeout=300), checkout)

    assert slurm.jobs(job)[0]["Restarts"] == "1"
    log = job_output(checkout, f"slurm-persrag-train-{job}.out")
    job_dir = Path("runs", "req", "user_encoder", "logs", f"slurm-{job}")
    assert "Handling auto-requeue signal" in log and f"Requeued SLURM job: {job}" in log
    assert f"resuming from {job_dir / 'hpc_ckpt_1.ckpt'}" in log and "(restart 1)" in log
    ref_dir, job_dir = checkout / "runs" / "ref" / "user_encoder" / "logs" / f"slurm-{ref}", checkout / job_dir
    assert (job_dir / "hpc_ckpt_1.ckpt").exists()

    want = torch.load(ref_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    got = torch.load(job_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert (got["epoch"], got["global_step"]) == (want["epoch"], want["global_step"]) == (2, 12)
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
    for a, b in zip(want["optimizer_states"][0]["state"].values(), got["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    first, resumed = read_csv_rows(job_dir / "metrics.0.csv"), read_csv_rows(job_dir / "metrics.csv")
    assert first[-1].startswith("1,7,")  # the first attempt logged epochs 0 and 1, the second the rest
    assert first + resumed == read_csv_rows(ref_dir / "metrics.csv")

    from persrag_lightning.models.user_encoder import UserEncoder

    exported = [UserEncoder.from_pretrained(checkout / "checkpoints" / run / "user_encoder").user_embeddings
                for run in ("ref", "req")]
    assert torch.equal(*exported)


def test_sweep_array_runs_each_point_in_its_own_run(slurm, checkout, tiny_bert, monkeypatch):
    """`slurm/sweep.py grid/submit/aggregate`: one array task per grid point, each in runs/<sweep>-<i>/ with the
    logger version slurm-<array job>_<i>, and a table with one row per point. Each task runs DDP over its 2 srun
    tasks (--ntasks-per-node=2 → --trainer.devices=2): 32 users / (2 ranks × 8) = 2 steps, one export."""
    sweep = checkout / "tau.yaml"
    sweep.write_text(yaml.safe_dump({"config": "cfrag_user_encoder.yaml", "grid": {
        "model.init_args.training.temperature": [0.1, 1.0]}, "args": [f"--data.init_args.encoder={tiny_bert}",
                                                              "--trainer.max_epochs=1", "--trainer.strategy=ddp",
                                                              *TINY_FIT]}))
    run = lambda *a: subprocess.run([sys.executable, str(REPO / "slurm" / "sweep.py"), *a], cwd=checkout,
                                    env={**slurm.env, **job_env()}, capture_output=True, text=True, check=True,
                                    timeout=120).stdout
    from persrag_lightning.data.synth import SynthConfig
    from persrag_lightning.datamodules.user_history import UserHistoryDataModule

    monkeypatch.chdir(checkout)  # cache the data once: the two tasks would race to build it
    UserHistoryDataModule(synth=SynthConfig(num_users=32), encoder=tiny_bert).prepare_data()
    run("grid", str(sweep))
    out = run("submit", "runs/sweeps/tau", "--", "--cpus-per-task=1", "--ntasks-per-node=2")
    job = out.strip().rsplit(" ", 1)[-1]
    assert_completed(slurm.wait(job, timeout=300), checkout)
    for i in range(2):
        run_dir = checkout / "runs" / f"tau-{i}" / "user_encoder" / "logs" / f"slurm-{job}_{i}"
        last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert last["global_step"] == 2 and (run_dir / "metrics.csv").exists()
        log = job_output(checkout, f"slurm-sweep-tau-{job}_{i}.out")
        assert "MEMBER: 2/2" in log and log.count("exported user_encoder to") == 1
    table = run("aggregate", "runs/sweeps/tau", "--metric", "val/loss")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "index" not in line]
    assert len(rows) == 2 and "model.init_args.training.temperature" in table and "val/view_acc" in table
    results = (checkout / "runs" / "sweeps" / "tau" / "results.csv").read_text().splitlines()
    assert len(results) == 3 and all("," in r for r in results)
