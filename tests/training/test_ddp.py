"""DDP on CPU (gloo, real processes): the gathered InfoNCE has the single-process gradient, and `fit` with 2 processes
builds caches once, splits the users, syncs metrics, exports once and ends where a 1-process run on the same global
batches ends."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from persrag_lightning.modules.losses import info_nce

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the loss alone: torch.distributed + DistributedDataParallel, no Lightning --------------------------------------

def global_views(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_and_grads(model: nn.Module, xa: torch.Tensor, xb: torch.Tensor, negatives: str,
                   gather: bool) -> tuple[float, list[torch.Tensor]]:
    out = model(torch.cat([xa, xb]))  # one forward per step, as Lightning's DDP wraps training_step
    loss = info_nce(out[:len(xa)], out[len(xa):], 0.1, negatives, gather_negatives=gather)
    loss.backward()
    params = model.module.parameters() if hasattr(model, "module") else model.parameters()
    return loss.item(), [p.grad.clone() for p in params]


CASES = [(sizes, negatives, gather) for sizes in ((3, 3), (2, 4)) for negatives in ("all_views", "cross_view")
         for gather in (True, False)]


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """One process group for every case (spawning costs seconds): each case is one DDP step from the same init."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {}
        for sizes, negatives, gather in CASES:
            xa, xb = global_views(sum(sizes))
            start = sum(sizes[:rank])
            local = slice(start, start + sizes[rank])
            ddp = nn.parallel.DistributedDataParallel(make_model())
            results[(sizes, negatives, gather)] = loss_and_grads(ddp, xa[local], xb[local], negatives, gather)
            del ddp  # its reducer holds the group's work: gone before the group is
        torch.save(results, Path(out) / f"rank{rank}.pt")
        # neither rank tears the group down while the other still uses it (a rank torn down early once aborted in
        # gloo: "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_loss")
    mp.spawn(_ddp_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("negatives", ["all_views", "cross_view"])
@pytest.mark.parametrize("sizes", [(3, 3), (2, 4)])
def test_gathered_info_nce_has_the_single_process_gradient(ddp_results, negatives, sizes):
    """DDP averages the ranks' gradients; each rank returns world × its share of the global loss and the gather's
    backward sums the gradients of every rank's copy, so the average is the global batch's gradient (no extra
    scaling), also when ranks hold different numbers of users."""
    xa, xb = global_views(sum(sizes))
    single_loss, single_grads = loss_and_grads(make_model(), xa, xb, negatives, gather=False)
    ranks = [r[(sizes, negatives, True)] for r in ddp_results]
    for _, grads in ranks:  # DDP's all-reduce leaves every rank with the same (averaged) gradient
        for got, want in zip(grads, single_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert sum(loss for loss, _ in ranks) / 2 == pytest.approx(single_loss, rel=1e-5)


def test_local_info_nce_is_not_the_global_batch(ddp_results):
    """Without gathering, each rank contrasts only its own users: a different (smaller-batch) objective."""
    xa, xb = global_views(6)
    _, single_grads = loss_and_grads(make_model(), xa, xb, "all_views", gather=False)
    _, grads = ddp_results[0][((3, 3), "all_views", False)]
    assert not torch.allclose(grads[0], single_grads[0], atol=1e-4)



# ---- the CLI with `strategy: ddp`, 2 real processes (Lightning re-executes the script for rank 1) --------------------

WRAPPER = """
import os
from persrag_lightning.llm import hf
from persrag_lightning.models import text_encoder

def counted(what, original):
    def wrapper(*args, **kwargs):
        with open("builds.log", "a") as f:
            f.write(f"{what} {os.environ.get('LOCAL_RANK', '0')}\\n")
        return original(*args, **kwargs)
    return wrapper

text_encoder.TextEncoder.from_pretrained = counted("embed", text_encoder.TextEncoder.from_pretrained)
hf.HFLLM.__init__ = counted("llm", hf.HFLLM.__init__)
from persrag_lightning.cli import main
main()
"""


def run_cli(cwd: Path, *args: str, devices: int = 1, accelerator: str = "cpu") -> str:
    """`python train.py <args>` in a subprocess (DDP launches rank 1 by re-running it), recording which rank
    loads an embedding model or the LLM into cwd/builds.log; returns stdout + stderr."""
    (cwd / "counting_train.py").write_text(WRAPPER)
    if not (cwd / "configs").exists():
        shutil.copytree(REPO / "configs", cwd / "configs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WANDB_", "MASTER_", "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "counting_train.py", *args, f"--trainer.accelerator={accelerator}",
                          "--trainer.strategy=ddp", f"--trainer.devices={devices}", "--trainer.enable_progress_bar=false",
                          "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1"],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return out.stdout + out.stderr


def builds(cwd: Path) -> list[str]:
    path = cwd / "builds.log"
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


def final_metrics(csv_path: Path) -> dict[str, float]:
    rows = csv_path.read_text().splitlines()
    header, last = rows[0].split(","), rows[-1].split(",")
    return {k: float(v) for k, v in zip(header, last) if v and k not in ("epoch", "step")}


def test_a_profile_stage_one_on_two_processes_exports_what_one_process_does(tmp_path, tiny_bert):
    """`judgments: profile` trains nothing, so DDP has no gradient to reduce: two ranks validate, rank 0 exports once,
    and the export's user embeddings are the one-process run's."""
    from persrag_lightning.models.user_encoder import UserEncoder

    args = ["fit", "--config", "cfrag_user_encoder.yaml", f"--data.init_args.encoder={tiny_bert}",
            "--data.init_args.synth.num_users=16", "--data.init_args.task=LaMP-3", "--data.init_args.batch_size=8",
            "--model.init_args.config.judgments=profile"]
    exports = {}
    for name, devices in (("one", 1), ("two", 2)):
        cwd = tmp_path / name
        cwd.mkdir()
        out = run_cli(cwd, *args, "--run_name", name, devices=devices)
        assert out.count("exported user_encoder to") == 1
        exports[name] = UserEncoder.from_pretrained(cwd / "checkpoints" / name / "user_encoder")
    torch.testing.assert_close(exports["two"].user_embeddings, exports["one"].user_embeddings)


@pytest.mark.parametrize("judgments", ["none", "label", "paired"])
def test_user_encoder_on_two_processes_matches_one_on_the_same_global_batches(tmp_path, tiny_bert, judgments):
    """2 ranks × 8 users vs 1 rank × 16 users, gathered negatives, dropout 0, 2 epochs. The DistributedSampler's
    permutation depends only on (seed, epoch), and rank r takes positions r, r+2, ..., so the 2 ranks' batch s is
    the 1-rank batch s (in another row order): weights, losses and synced metrics agree; each run embeds its
    corpus once (rank 0's prepare_data) and exports once; 2 × 32 / 16 = 4 optimizer steps in both. `label`: the
    judgment-aware encoder on SynthLaMP LaMP-3, its label table and doc labels included; `paired`
    with its per-label maps as well."""
    args = ["fit", "--config", "cfrag_user_encoder.yaml", f"--data.init_args.encoder={tiny_bert}",
            "--data.init_args.synth.num_users=32", "--trainer.max_epochs=2", "--model.init_args.config.dropout=0",
            "--model.init_args.training.gather_negatives=true", f"--model.init_args.config.judgments={judgments}"]
    if judgments != "none":
        args.append("--data.init_args.task=LaMP-3")
    runs = {}
    for name, devices, batch in (("one", 1, 16), ("two", 2, 8)):
        cwd = tmp_path / name
        cwd.mkdir()
        out = run_cli(cwd, *args, f"--data.init_args.batch_size={batch}", "--run_name", name, devices=devices)
        # the corpus and the "<mask>" text (the [mask] row) embedded once each, by rank 0; rank 1 read the caches
        assert builds(cwd) == ["embed 0", "embed 0"]
        assert out.count("exported user_encoder to") == 1
        logs = cwd / "runs" / name / "user_encoder" / "logs" / "version_0"
        runs[name] = (torch.load(logs / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False),
                      (logs / "metrics.csv").read_text().splitlines(), cwd / "checkpoints" / name / "user_encoder")
    (one, one_rows, one_export), (two, two_rows, two_export) = runs["one"], runs["two"]
    assert one["global_step"] == two["global_step"] == 4
    assert ("encoder.label_table.weight" in one["state_dict"]) == (judgments != "none")
    assert ("encoder.label_maps" in one["state_dict"]) == (judgments == "paired")
    for key, want in one["state_dict"].items():
        got = two["state_dict"][key]
        if key.endswith("in_proj_bias"):  # the key bias has no gradient (softmax ignores it): Adam's noise
            want, got = want.view(3, -1)[[0, 2]], got.view(3, -1)[[0, 2]]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=key)
    assert one_rows[0] == two_rows[0] and len(one_rows) == len(two_rows)
    for a, b in zip(one_rows[1:], two_rows[1:]):  # per-step train/loss (synced) and per-epoch val metrics
        assert a.split(",")[:2] == b.split(",")[:2]
        for x, y in zip(a.split(",")[2:], b.split(",")[2:]):
            assert (x == y == "") or float(x) == pytest.approx(float(y), rel=1e-5), (a, b)
    from persrag_lightning.models.user_encoder import UserEncoder

    torch.testing.assert_close(UserEncoder.from_pretrained(two_export).user_embeddings,
                               UserEncoder.from_pretrained(one_export).user_embeddings, atol=1e-5, rtol=1e-4)


SYNTH = {"num_users": 16, "docs_per_user": [6, 10], "train_questions_per_user": 2, "dev_questions_per_user": 1}


def feedback_world(root: Path, tiny_bert: str, caches: tuple[str, ...] = ("cache",)) -> Path:
    """What stage 2 needs from stage 1: SynthLaMP, its corpus embedded by the tiny encoder (in each cache), and
    an untrained user-encoder export at root/user_encoder."""
    from persrag_lightning.data.corpus import Corpus
    from persrag_lightning.data.source import LampSource
    from persrag_lightning.data.synth import SynthConfig
    from persrag_lightning.models.corpus_embeddings import build_corpus_embeddings, load_corpus_embeddings
    from persrag_lightning.models.user_encoder import UserEncoder, UserEncoderConfig

    for cache in caches:
        source = LampSource("LaMP-2", None, SynthConfig(**SYNTH), str(root / cache))
        source.prepare()
        corpus = Corpus.from_dataset(source.load())
        build_corpus_embeddings(corpus, root / cache, encoder=tiny_bert)
    table = load_corpus_embeddings(root / caches[0], corpus, encoder=tiny_bert)
    torch.manual_seed(0)
    encoder = UserEncoder(UserEncoderConfig(dim=table.shape[1], num_docs=len(corpus)), table).eval()
    encoder.index_users(corpus.user_ids, torch.randn(len(corpus.user_ids), table.shape[1]))
    encoder.save_pretrained(root / "user_encoder")
    return root / "user_encoder"


def feedback_data_args(root: Path, tiny_llm: str, candidate_retriever: str) -> list[str]:
    return [*(f"--data.init_args.synth.{k}={json.dumps(v)}" for k, v in SYNTH.items()),
            f"--data.init_args.cache_dir={root / 'cache'}",
            f"--data.init_args.candidates.user_encoder={root / 'user_encoder'}",
            f"--data.init_args.candidates.retriever={candidate_retriever}",
            "--data.init_args.candidates.m=3", "--data.init_args.candidates.k=2",
            f"--data.init_args.feedback.llm.model={tiny_llm}", "--data.init_args.feedback.llm.batch_size=8",
            '--data.init_args.feedback.llm.options={"device": "cpu"}', "--data.init_args.feedback.chunk_size=8",
            "--data.init_args.feedback.metric=loglik", "--data.init_args.batch_size=4"]


def test_retriever_and_reranker_train_on_two_processes(tmp_path, tiny_bert, tiny_llm):
    """Stages 2 and 3 with `strategy: ddp` on 2 processes: rank 0's prepare_data labels the candidates (the LLM
    is loaded once), each rank trains on half of the 32 examples (32 / (2 × 4) = 4 steps), rank 0 exports, and
    the synced validation metrics equal those of a 1-process `validate` of the same checkpoint."""
    feedback_world(tmp_path, tiny_bert)
    stages = (("cfrag_retriever.yaml", "retriever", tiny_bert, ["--model.init_args.config.max_length=64"]),
              ("cfrag_reranker.yaml", "reranker", str(tmp_path / "checkpoints" / "d" / "retriever"),
               ["--model.init_args.config.max_query_length=32", "--model.init_args.config.max_doc_length=32"]))
    for config, stage, candidates, model_args in stages:
        args = ["--config", config, "--run_name", "d", *feedback_data_args(tmp_path, tiny_llm, candidates),
                f"--model.init_args.config.encoder={tiny_bert}", "--model.init_args.training.lr=1e-3", *model_args,
                "--trainer.max_epochs=1", "--trainer.accumulate_grad_batches=1"]
        out = run_cli(tmp_path, "fit", *args, devices=2)
        assert [b for b in builds(tmp_path) if b.startswith("llm")] == ["llm 0"], stage
        assert out.count(f"exported {stage} to") == 1
        logs = tmp_path / "runs" / "d" / stage / "logs"
        fitted = final_metrics(logs / "version_0" / "metrics.csv")  # after fit: validation of the best checkpoint
        best = next((logs / "version_0" / "checkpoints").glob("epoch=*.ckpt"))
        assert torch.load(best, map_location="cpu", weights_only=False)["global_step"] == 4
        run_cli(tmp_path, "validate", *args, f"--ckpt_path={best}", devices=1)
        assert not [b for b in builds(tmp_path) if b.startswith("llm")]  # the labels are read from the cache
        single = final_metrics(logs / "version_1" / "metrics.csv")
        for name in ("val/kl", "val/ndcg@5", "val/recall@5"):
            # abs: the KL of near-uniform lists is ~1e-6, where float32 summation order (2 ranks vs 1) moves
            # the last digits; 1e-8 is still far below any difference a wrong sync or split would make
            assert single[name] == pytest.approx(fitted[name], rel=1e-5, abs=1e-8), (stage, name)
