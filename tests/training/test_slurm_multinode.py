"""Slurm past one machine: a two-node cluster in network namespaces (tests/helpers/slurm_multinode.py) runs the real sbatch
templates. The retriever stage trains with DDP across both nodes (gloo) and ends where one process on the same
global batches ends; a node crash mid-epoch requeues the job, both nodes resume from the same checkpoint and end
with the uninterrupted run's weights; a feedback array spread over both nodes survives the crash of one of them
with every label present once. Caches on the folder both nodes share are built once, never raced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.slurm_cluster import missing_binaries
from tests.helpers.slurm_multinode import (
    MultiNodeCluster,
    NetworkUnavailable,
    netns_unavailable,
    start_multinode_cluster,
)
from tests.training.test_ddp import SYNTH, feedback_data_args, feedback_world
from tests.training.test_slurm import assert_completed, job_env, job_output
from tests.training.test_slurm import checkout as checkout  # noqa: PLC0414 - a fixture, re-exported for this module

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "slurm" / "train.sbatch")
FEEDBACK = str(REPO / "slurm" / "feedback_array.sbatch")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# train.py of the test checkouts: the CLI, with every corpus embedding build, LLM load and feedback chunk written
# appended to builds.log (what, host, Slurm task, restart), and, where PAUSE_DIR is set, a first attempt of a
# feedback task that pauses after its first chunk until the test lets it go
WRAPPER = """
import os, socket, time
from pathlib import Path
from persrag_lightning.data import feedback_cache
from persrag_lightning.llm import hf
from persrag_lightning.models import corpus_embeddings

def note(*what):
    where = (socket.gethostname(), os.environ.get("SLURM_ARRAY_TASK_ID", os.environ.get("SLURM_PROCID", "-")),
             os.environ.get("SLURM_RESTART_COUNT", "0"))
    with open("builds.log", "a") as f:
        f.write(" ".join(map(str, (*what, *where))) + "\\n")

def counted(what, original):
    def wrapper(*args, **kwargs):
        note(what)
        return original(*args, **kwargs)
    return wrapper

corpus_embeddings._embed_corpus = counted("embed", corpus_embeddings._embed_corpus)
hf.HFLLM.__init__ = counted("llm", hf.HFLLM.__init__)
write_chunk = feedback_cache.FeedbackCache.write_chunk

def noted_write_chunk(self, split, chunk, records):
    write_chunk(self, split, chunk, records)
    note("chunk", f"{split}/{chunk}", len(records))
    pause = os.environ.get("PAUSE_DIR")
    if pause and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        Path(pause, f"paused-{os.environ['SLURM_ARRAY_TASK_ID']}").write_text(socket.gethostname())
        deadline = time.monotonic() + 300
        while not Path(pause, "go").exists() and time.monotonic() < deadline:
            time.sleep(0.2)

feedback_cache.FeedbackCache.write_chunk = noted_write_chunk
from persrag_lightning.cli import main
main()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> MultiNodeCluster:
    """Two nodes of 2 CPUs each (so that 4 one-CPU array tasks spread 2 + 2), started once for this file; the
    daemons' logs and slurm.conf are kept in pytest's temp folder `cluster-logs*`."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}); `bash .ci/install_slurm.sh` installs "
                    "slurm-wlm, munge and iproute2 where apt-get and root are available")
    why = netns_unavailable()
    if why:
        pytest.skip(f"the two-node test cluster needs network namespaces: {why}")
    try:
        c = start_multinode_cluster(nodes=2, cpus=2)
    except NetworkUnavailable as err:  # the machine's firewall, not this code: nothing to test here
        pytest.skip(f"the two-node test cluster cannot work here: {err}")
    yield c
    c.stop(keep_logs=tmp_path_factory.mktemp("cluster-logs"))


@pytest.fixture(scope="module")
def tiny_bert_no_dropout(tmp_path_factory) -> str:
    """The tiny BERT of conftest without dropout: DDP ranks and a single process then compute the same function."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from persrag_lightning.models.text_encoder import resolve_model_path

    path = tmp_path_factory.mktemp("tiny_bert_no_dropout")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prepared(checkout: Path, encoder: str) -> Path:
    """Stage 1's export (built in cache_stage1), the counting train.py; the jobs' cache folder `cache` is empty."""
    feedback_world(checkout, encoder, caches=("cache_stage1",))
    (checkout / "train.py").write_text(WRAPPER)
    return checkout


def builds(checkout: Path) -> list[list[str]]:
    path = checkout / "builds.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def records(folder: Path, tag: str) -> dict[str, dict]:
    """RecordRanks' files of one run: '<restart>-<rank>' → record."""
    return {f"{r['restart']}-{r['global_rank']}": r for r in (json.loads(p.read_text())
                                                               for p in sorted(folder.glob(f"{tag}-*.json")))}


def bundle_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported bundle (its safetensors files), keyed by file and name."""
    from safetensors.torch import load_file

    return {f"{p.relative_to(folder)}:{k}": v for p in sorted(folder.rglob("*.safetensors"))
            for k, v in load_file(str(p)).items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((x.float() - b[k].float()).abs().max().item() for k, x in a.items() if x.numel())


def test_retriever_ddp_across_two_nodes_matches_one_process_and_resumes_after_a_node_crash(
        cluster, checkout, tiny_bert_no_dropout, tiny_llm):
    """`sbatch --nodes=2 --ntasks-per-node=1 slurm/train.sbatch cfrag_retriever.yaml`, twice at once:
    - world size 2, rank r on node r+1 (SLURMEnvironment: node rank from SLURM_NODEID, master node1, gloo);
    - each epoch the two ranks read disjoint halves of the 32 training examples, and their step-s batches together
      are the step-s batch of one process with twice the batch size (DistributedSampler's order is (seed, epoch));
    - the candidate retriever's corpus embeddings and the feedback labels in the shared cache folder are built
      once for the whole cluster (both nodes' prepare_data of both jobs: the others wait on the file locks);
    - one job is crashed mid-epoch 1 (node2 off the network, every process on it SIGKILLed): slurmctld declares
      node2 down, requeues the job (NODE_FAIL), node2 comes back, both nodes resume from epoch 0's last.ckpt;
    - last.ckpt of the uninterrupted job, of the requeued job and of one process (same global batch of 8) hold
      the same weights: requeued = uninterrupted exactly, two nodes = one process to float32 rounding."""
    encoder = tiny_bert_no_dropout
    prepared(checkout, encoder)
    out = checkout / "ranks"
    args = [*feedback_data_args(checkout, tiny_llm, encoder),
            f"--model.init_args.config.encoder={encoder}", "--model.init_args.training.lr=1e-3", "--model.init_args.config.max_length=64",
            "--trainer.max_epochs=2", "--trainer.accumulate_grad_batches=1", "--trainer.accelerator=cpu",
            "--trainer.strategy=ddp", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.log_every_n_steps=1"]
    record = lambda tag: "--trainer.callbacks+=" + json.dumps(
        {"class_path": "tests.helpers.slurm_multinode.RecordRanks", "init_args": {"out": str(out), "tag": tag}})
    marker = checkout / "paused"
    pause = "--trainer.callbacks+=" + json.dumps({"class_path": "tests.helpers.slurm_multinode.PauseMidEpoch",
                                                  "init_args": {"marker": str(marker), "epoch": 1, "batch": 1}})
    env = {**job_env(), **ONE_THREAD}
    nodes = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1")
    stage = (TRAIN, "cfrag_retriever.yaml")
    ref = cluster.sbatch(*nodes, *stage, "--run_name", "ref", *args, record("ref"), cwd=checkout, env=env)
    req = cluster.sbatch(*nodes, *stage, "--run_name", "req", *args, record("req"), pause, cwd=checkout, env=env)
    req_log = lambda: job_output(checkout, f"slurm-persrag-train-{req}.out")

    paused = [Path(f"{marker}-rank{r}") for r in range(2)]
    cluster.wait(req, timeout=600, until=lambda jobs: all(p.exists() for p in paused) or
                 jobs[0]["JobState"] not in ("PENDING", "RUNNING"))
    assert all(p.exists() for p in paused), req_log()[-6000:]
    assert sorted(p.read_text() for p in paused) == ["node1", "node2"]
    assert_completed(cluster.wait(ref, timeout=600), checkout)

    cluster.crash("node2")
    # requeued (restart 1), waiting for two nodes: node1 alone cannot run it
    cluster.wait(req, timeout=120, until=lambda jobs: (jobs[0]["Restarts"], jobs[0]["JobState"]) == ("1", "PENDING"))
    assert cluster.node_states()["node2"].startswith("down")
    single_env = {k: v for k, v in cluster.env.items() if k != "SLURM_CONF"}
    single = subprocess.Popen(  # one process, the global batch of 8, while the cluster recovers
        [sys.executable, "train.py", "fit", "--config", "cfrag_retriever.yaml", *args, "--run_name", "single",
         "--data.init_args.batch_size=8", "--trainer.devices=1", record("single")], cwd=checkout,
        env={**single_env, **job_env(), **ONE_THREAD},  # job_env: the repository on the path, for the callback
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cluster.revive("node2")
    assert_completed(cluster.wait(req, timeout=600), checkout)
    single_out, _ = single.communicate(timeout=600)
    assert single.returncode == 0, single_out[-6000:]

    # where each rank ran, and what each read
    ref_ranks, req_ranks, one = records(out, "ref"), records(out, "req"), records(out, "single")["0-0"]
    for r in (0, 1):
        rec = ref_ranks[f"0-{r}"]
        assert (rec["hostname"], rec["node_rank"], rec["local_rank"]) == (f"node{r + 1}", r, 0)
        assert (rec["world_size"], rec["num_nodes"], rec["backend"]) == (2, 2, "gloo")
        assert rec["cluster_environment"] == "SLURMEnvironment" and rec["master"] == ["node1", 15000 + int(ref[-4:])]
    assert one["world_size"] == 1
    for epoch in ("0", "1"):
        ranks = [ref_ranks[f"0-{r}"]["epochs"][epoch] for r in (0, 1)]
        seen = [{i for batch in rank for i in batch} for rank in ranks]
        assert len(seen[0]) == len(seen[1]) == 16 and not seen[0] & seen[1]
        assert seen[0] | seen[1] == {i for batch in one["epochs"][epoch] for i in batch}
        for step, batch in enumerate(one["epochs"][epoch]):
            assert set(ranks[0][step]) | set(ranks[1][step]) == set(batch), (epoch, step)
    # the requeued job: epoch 0 in its first attempt, epoch 1 (whole) after the restart, each rank its own shard
    for r in (0, 1):
        assert req_ranks[f"0-{r}"]["epochs"]["0"] == ref_ranks[f"0-{r}"]["epochs"]["0"]
        assert req_ranks[f"1-{r}"]["epochs"] == {"1": ref_ranks[f"0-{r}"]["epochs"]["1"]}
        assert req_ranks[f"1-{r}"]["hostname"] == f"node{r + 1}"

    # caches built once on the shared folder (by one node of one job), never raced
    built = builds(checkout)
    assert [b[0] for b in built if b[0] in ("embed", "llm")] == ["embed", "llm"], built
    assert {b[1] for b in built if b[0] in ("embed", "llm")} <= {"node1", "node2"}
    chunks = [b[1] for b in built if b[0] == "chunk"]
    assert sorted(chunks) == ["dev/0", "dev/1", "train/0", "train/1", "train/2", "train/3"]  # each once

    # the crash, the requeue and the resume, as the job's log tells them
    log = req_log()
    job_dir = Path("runs", "req", "retriever", "logs", f"slurm-{req}")
    assert "Node failure on node2" in log and "DUE TO NODE FAILURE" in log and "(restart 1)" in log
    assert f"resuming from {job_dir / 'checkpoints' / 'last.ckpt'}" in log
    assert job_output(checkout, f"slurm-persrag-train-{ref}.out").count("exported retriever to") == 1

    # the weights: each rank's at the end of training, and the exported bundles (the best epoch's)
    weights = {name: torch.load(out / f"{name}-weights.pt", map_location="cpu") for name in
               ("ref-restart0-rank0", "ref-restart0-rank1", "req-restart1-rank0", "req-restart1-rank1",
                "single-restart0-rank0")}
    assert {r["global_step"] for r in (*ref_ranks.values(), req_ranks["1-0"], req_ranks["1-1"], one)} == {8}
    ref_w, req_w = weights["ref-restart0-rank0"], weights["req-restart1-rank0"]
    one_w = weights["single-restart0-rank0"]
    diffs = {"two nodes vs one process": max_abs_diff(ref_w, one_w),
             "requeued two nodes vs one process": max_abs_diff(req_w, one_w),
             "requeued vs uninterrupted two nodes": max_abs_diff(req_w, ref_w),
             "rank 1 vs rank 0 (two nodes)": max_abs_diff(weights["ref-restart0-rank1"], ref_w),
             "rank 1 vs rank 0 (requeued)": max_abs_diff(weights["req-restart1-rank1"], req_w)}
    exported = {name: bundle_tensors(checkout / "checkpoints" / name / "retriever")
                for name in ("ref", "req", "single")}
    diffs["exports: two nodes vs one process"] = max_abs_diff(exported["ref"], exported["single"])
    diffs["exports: requeued vs uninterrupted"] = max_abs_diff(exported["req"], exported["ref"])
    # Adam divides by sqrt(v): float32 sum-order differences of near-zero gradients (a LayerNorm bias) grow to a
    # small fraction of lr per step, while another batch moves a weight by about lr per step; hence atol = lr / 10,
    # and the check below that training moved the weights by far more than that
    tol = {"atol": 1e-4, "rtol": 1e-4}
    initial = torch.load(out / "single-restart0-rank0-initial.pt", map_location="cpu")
    diffs["trained vs initial (one process)"] = max_abs_diff(one_w, initial)
    print("largest absolute weight difference: " + json.dumps(diffs))
    (out / "weight-diffs.json").write_text(json.dumps(diffs, indent=1))
    assert diffs["trained vs initial (one process)"] > 20 * tol["atol"]
    for key, want in one_w.items():
        torch.testing.assert_close(ref_w[key], want, **tol, msg=key)
        torch.testing.assert_close(req_w[key], want, **tol, msg=key)
    for key, want in exported["single"].items():
        torch.testing.assert_close(exported["ref"][key], want, **tol, msg=key)
    assert diffs["requeued vs uninterrupted two nodes"] == diffs["exports: requeued vs uninterrupted"] == 0
    assert diffs["rank 1 vs rank 0 (two nodes)"] == diffs["rank 1 vs rank 0 (requeued)"] == 0


def test_feedback_array_on_both_nodes_survives_a_node_crash_with_every_label_once(cluster, checkout,
                                                                                  tiny_bert_no_dropout, tiny_llm):
    """`sbatch --array=0-3 slurm/feedback_array.sbatch`: 4 one-CPU tasks, 2 on each node; each first attempt
    pauses after writing its first chunk; node2 crashes; its 2 tasks are requeued (NODE_FAIL), the others go on;
    the requeued tasks write only their missing chunks. Every chunk is written once, and the labels hold every
    train and dev example exactly once, each with its m·k candidates."""
    encoder = tiny_bert_no_dropout
    prepared(checkout, encoder)
    config = checkout / "feedback.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"class_path": "persrag_lightning.modules.retriever.RetrieverModule"},
        "data": {"class_path": "persrag_lightning.datamodules.feedback.FeedbackDataModule", "init_args": {
            "synth": SYNTH, "cache_dir": "cache",
            "candidates": {"user_encoder": str(checkout / "user_encoder"), "retriever": encoder, "m": 3, "k": 2},
            "feedback": {"llm": {"model": tiny_llm, "batch_size": 8, "options": {"device": "cpu"}},
                         "chunk_size": 4}}}}))
    pause_dir = checkout / "pause"
    pause_dir.mkdir()
    job = cluster.sbatch("--array=0-3", "--cpus-per-task=1", FEEDBACK, str(config), cwd=checkout,
                         env={**job_env(), **ONE_THREAD, "PAUSE_DIR": str(pause_dir)})
    markers = [pause_dir / f"paused-{i}" for i in range(4)]
    cluster.wait(job, timeout=600, until=lambda tasks: all(m.exists() for m in markers) or
                 any(t["JobState"] not in ("PENDING", "RUNNING") for t in tasks))
    assert all(m.exists() for m in markers), job_output(checkout, f"slurm-persrag-feedback-{job}_*.out")[-6000:]
    on = {i: m.read_text() for i, m in enumerate(markers)}
    assert sorted(on.values()) == ["node1", "node1", "node2", "node2"]

    cluster.crash("node2")
    crashed = sorted(str(i) for i, host in on.items() if host == "node2")
    cluster.wait(job, timeout=120, until=lambda tasks: all(
        t["Restarts"] == "1" for t in tasks if t["ArrayTaskId"] in crashed))
    (pause_dir / "go").touch()
    cluster.revive("node2")
    tasks = cluster.wait(job, timeout=600)
    assert_completed(tasks, checkout)
    assert {t["ArrayTaskId"]: t["Restarts"] for t in tasks} == {str(i): str(int(str(i) in crashed))
                                                                  for i in range(4)}

    built = builds(checkout)
    written = [b[1] for b in built if b[0] == "chunk"]
    assert sorted(written) == sorted([f"train/{c}" for c in range(8)] + [f"dev/{c}" for c in range(4)]), built
    for task in crashed:  # its first chunk before the crash, the other two after the requeue
        assert [b[5] for b in built if b[0] == "chunk" and b[4] == task] == ["0", "1", "1"], built
    assert [b[0] for b in built if b[0] == "embed"] == ["embed"]  # the corpus once, for all four tasks

    from persrag_lightning.data.source import LampSource
    from persrag_lightning.data.synth import SynthConfig

    examples = LampSource("LaMP-2", None, SynthConfig(**SYNTH), str(checkout / "cache")).load().examples
    for split, n in (("train", 32), ("dev", 16)):
        ids = [json.loads(line)["example_id"] for p in sorted((checkout / "cache").rglob(f"{split}/chunk-*.jsonl"))
               for line in p.read_text().splitlines()]
        want = sorted(e.example_id for e in examples[split] if e.target is not None)
        assert len(ids) == n and sorted(ids) == want  # every label present, once
    for p in (checkout / "cache").rglob("chunk-*.jsonl"):
        for line in p.read_text().splitlines():
            assert len(json.loads(line)["candidates"]) == 3 * 2, p
