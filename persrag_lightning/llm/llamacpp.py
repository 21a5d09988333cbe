"""llama-cpp-python backend: runs the GGUF directly (no de-quantisation), fastest on small CPUs."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from persrag_lightning.llm.base import LLM, LLMBackendError, ModelSource, cache_root, resolve_model

__all__ = ["LlamaCppLLM"]

_INSTALL_HINT = "the llamacpp backend needs llama-cpp-python: `pip install llama-cpp-python`"
# `weights`: the GGUF as shipped, or re-encoded once by llama.cpp's own quantizer into a type with a
# fast CPU kernel. SmolLM2 ships as Q4_1, which this CPU backend has no batched kernel for on most
# CPUs (no repacking, no llamafile GEMM): a prompt runs barely faster than one-token decoding
# (docs/performance/llm-feedback.md). F16 / BF16 / Q4_0 go through llamafile's GEMM or the repacked
# Q4_0 kernel.
# `auto` (the default) picks f16 for such a file: it holds the Q4_1 values (4-bit codes times f16
# scales, plus f16 minimums) to within f16 rounding and, unlike the Q4_1 kernel, does not round the
# activations to 8 bits, so it answered like float32 transformers on every benchmark prompt (the
# shipped file did not) and faster than the shipped file; bf16 is faster again with a few different
# answers (docs/performance/llm-feedback.md). KV sequences of the scoring context: `score_options`
# decodes up to this many options in one call (LaMP-2 has 15 labels; older llama.cpp builds allow 64
# sequences at most).
OPTION_SEQS = 64
WEIGHT_TYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16", "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
                "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def _import_llama() -> Any:
    try:
        import llama_cpp
    except ImportError as err:
        raise LLMBackendError(_INSTALL_HINT) from err
    return llama_cpp


class LlamaCppLLM(LLM):
    """One llama.cpp context for greedy chat completion (prefix KV reuse across prompts), one for
    `score` and `score_options` (outputs only at the positions whose logits are read)."""

    backend = "llamacpp"

    def __init__(self, model: str = "smollm2", batch_size: int = 1, n_ctx: int = 2048,
                 n_threads: int | None = None, n_batch: int = 512, seed: int = 0, verbose: bool = False,
                 weights: str = "auto", cache_dir: str | os.PathLike | None = None, score_seqs: int = 1,
                 flash_attn: bool = True) -> None:
        """`weights`: `gguf` runs the file as shipped; f32, f16, bf16, q8_0 or q4_0 re-encode it
        once (cached under `<cache>/llm/`) into a type with a fast CPU kernel, in the fingerprint
        since answers change; `auto` (default) is f16 for a small Q4_1 file (the embedded SmolLM2)
        and the shipped file otherwise (a large model in f16 would need four times the memory of its
        4-bit file and decode slower). `score_seqs`: pairs per llama_decode call in `score`; 1
        (default) was fastest on 2 CPU cores, 2 and 4 slower (docs/performance/llm-feedback.md).
        `flash_attn`: llama.cpp's fused attention kernel in the scoring context (`score`,
        `score_options`), on by default: labels faster on 2 CPU cores, within 0.02 nat of the
        unfused kernel's; off reproduces the labels of caches made before it. Generation keeps the
        unfused kernel: with the fused one a greedy LaMP-5 title left the exact model's
        (docs/performance/llm-feedback.md)."""
        super().__init__(
            batch_size
        )  # llama.cpp evaluates one sequence at a time; kept for the interface
        self._llama_cpp = _import_llama()
        self.source = resolve_model(model)
        if not self.source.is_gguf:
            raise LLMBackendError(
                f"the llamacpp backend needs a GGUF file; {model!r} resolved to {self.source.path}"
            )
        if weights not in ("auto", "gguf") and weights not in WEIGHT_TYPES:
            raise LLMBackendError(
                f"llamacpp weights must be auto, gguf or one of {', '.join(WEIGHT_TYPES)}, "
                f"got {weights!r}"
            )
        self.weights = weights = auto_weights(self.source.path) if weights == "auto" else weights
        self.model_path = self.source.path if weights == "gguf" else str(
            reencoded_gguf(self.source, weights, cache_dir))
        self.n_ctx = n_ctx
        self.n_threads = n_threads  # None: llama-cpp-python's default (half the logical cores)
        self.n_batch = n_batch
        self.seed = seed
        self.verbose = verbose
        self.score_seqs = score_seqs
        self.flash_attn = flash_attn
        # options per llama_decode call in `score_options` (1: one call per option, as its first
        # version did)
        self.option_seqs = OPTION_SEQS
        self.engine = self._new_context()
        self._packer: Any = None  # (context, batch) for score and score_options
        self._formatter: Any = None

    def _new_context(self) -> Any:
        threads = {} if self.n_threads is None else {"n_threads": self.n_threads, "n_threads_batch": self.n_threads}
        try:
            return self._llama_cpp.Llama(model_path=self.model_path, n_ctx=self.n_ctx, n_batch=self.n_batch,
                                         seed=self.seed, verbose=self.verbose, **threads)
        except Exception as err:  # llama.cpp reports load failures as ValueError/RuntimeError
            raise LLMBackendError(f"llama.cpp could not load {self.model_path}: {err}") from err

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def settings(self) -> dict[str, object]:
        # the shipped weights without flash attention keep the fingerprint they had before `weights`
        # and `flash_attn` existed (caches stay valid); either changes the labels' last digits, so
        # it is in the key (answers too, conservatively: generation does not use flash attention)
        settings: dict[str, object] = {"n_ctx": self.n_ctx}
        if self.weights != "gguf":
            settings["weights"] = self.weights
        if self.flash_attn:
            settings["flash_attn"] = True
        return settings

    def _digest(self) -> str:
        return self.source.digest

    def count_tokens(self, text: str) -> int:
        return len(self.engine.tokenize(text.encode(), add_bos=False, special=False)) if text else 0

    supports_json_schema = True

    def generate(
        self, prompts: list[str], max_new_tokens: int, json_schema: dict | None = None
    ) -> list[str]:
        """Greedy answers; with `json_schema`, decoding follows llama.cpp's grammar built from the
        schema (`LlamaGrammar.from_json_schema`), so the answer is JSON of that shape unless the
        token budget cuts it."""
        grammar = {} if json_schema is None else {"grammar": self._grammar(json_schema)}
        outputs = []
        for prompt in prompts:
            try:
                out = self.engine.create_chat_completion(
                    messages=[{"role": "user", "content": prompt}], temperature=0.0, top_k=1,
                    max_tokens=max_new_tokens, seed=self.seed, **grammar)
            except ValueError as err:  # e.g. prompt longer than n_ctx
                raise LLMBackendError(
                    f"llama.cpp generate failed on {self.name} (n_ctx={self.n_ctx}): {err}"
                ) from err
            outputs.append((out["choices"][0]["message"]["content"] or "").strip())
        return outputs

    def _grammar(self, schema: dict) -> Any:
        """llama.cpp's GBNF grammar of a JSON schema, built once per schema."""
        key = json.dumps(schema, sort_keys=True)
        cache = self.__dict__.setdefault("_grammars", {})
        if key not in cache:
            from llama_cpp import LlamaGrammar

            cache[key] = LlamaGrammar.from_json_schema(key, verbose=self.verbose)
        return cache[key]

    def chat_text(self, prompt: str) -> str:
        """The prompt through the GGUF's own chat template, exactly as `create_chat_completion`
        renders it."""
        if self._formatter is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            template = self.engine.metadata.get("tokenizer.chat_template")
            if not template:
                raise NotImplementedError(
                    f"{self.source.path} has no chat template; llamacpp score() needs one"
                )
            vocab = self.engine._model
            self._formatter = Jinja2ChatFormatter(
                template=template, eos_token=vocab.token_get_text(self.engine.token_eos()),
                bos_token=vocab.token_get_text(self.engine.token_bos()), add_generation_prompt=True)
        return self._formatter(messages=[{"role": "user", "content": prompt}]).prompt

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        """log p(target | chat prompt) per pair, with logits asked only at the positions that
        predict the target.

        A `logits_all` context (what this used before 2026-11-23) projects every prompt token onto
        the 49k-word vocabulary and copies those logits out; here each pair goes through llama.cpp's
        batch API with the output flag set on its target positions alone, and `score_seqs` pairs
        share one `llama_decode` call, each in its own KV sequence (docs/performance/llm-feedback.md
        measures 1, 2 and 4)."""
        self._check_pairs(prompts, targets)
        scores = [0.0] * len(prompts)
        pack: list[tuple[int, list[int], int]] = []  # (pair index, tokens, prompt tokens)
        used = 0
        for i, (prompt, target) in enumerate(zip(prompts, targets)):
            head = self.engine.tokenize(self.chat_text(prompt).encode(), add_bos=True, special=True)
            tail = self.engine.tokenize(target.encode(), add_bos=False, special=False) if target else []
            if not tail:
                continue
            tokens = head + tail
            if len(tokens) > self.n_ctx:
                raise LLMBackendError(
                    f"llama.cpp score: {len(tokens)} tokens exceed n_ctx={self.n_ctx}"
                )
            if pack and (len(pack) == self.score_seqs or used + len(tokens) > self.n_ctx):
                self._score_pack(pack, scores)
                pack, used = [], 0
            pack.append((i, tokens, len(head)))
            used += len(tokens)
        if pack:
            self._score_pack(pack, scores)
        return scores

    def _score_pack(self, pack: list[tuple[int, list[int], int]], scores: list[float]) -> None:
        """One `llama_decode` of the pairs in `pack` (sequence id = place in the pack, positions
        from 0)."""
        self._batch_context()[0].kv_cache_clear()
        bases = self._decode([(tokens, seq, 0, n_head - 1, len(tokens) - 1)
                              for seq, (_, tokens, n_head) in enumerate(pack)])
        for (i, tokens, n_head), base in zip(pack, bases):
            tail = tokens[n_head:]
            logp = self._log_probs(base + n_head - 1, len(tail))
            scores[i] = float(logp[np.arange(len(tail)), tail].sum())

    def score_options(self, prompts: list[str], options: list[str]) -> list[list[float]]:
        """`score` of every option per prompt, evaluating each prompt once and all options over its
        KV cache at once.

        The prompt is decoded with one output, its last position's, which scores every option's
        first token. The options of more than one token then go through ONE `llama_decode`, option j
        in KV sequence j: the prompt's cells are shared with every sequence (`seq_cp` only tags
        cells in the unified cache, nothing is copied), so each option attends to the prompt and its
        own earlier tokens only and is scored as `score` scores it alone. One call per option (this
        method's first version) paid llama.cpp's per-call overhead 15 times per LaMP-2 prompt.
        Options are tokenised exactly as `score` tokenises targets.
        """
        self._check_options(options)
        ctx = self._batch_context()[0]
        tails = [self.engine.tokenize(o.encode(), add_bos=False, special=False) if o else [] for o in options]
        longer = [k for k, tail in enumerate(tails) if len(tail) > 1]
        rows = []
        for prompt in prompts:
            head = self.engine.tokenize(self.chat_text(prompt).encode(), add_bos=True, special=True)
            if len(head) + max(len(t) for t in tails) > self.n_ctx:
                raise LLMBackendError(
                    f"llama.cpp score_options: {len(head)} prompt tokens plus the longest option "
                    f"exceed n_ctx={self.n_ctx}"
                )
            ctx.kv_cache_clear()
            (base,) = self._decode([(head, 0, 0, len(head) - 1, len(head))])
            first = self._log_probs(base + len(head) - 1, 1)[0]
            row = [float(first[tail[0]]) if tail else 0.0 for tail in tails]
            for group in _option_groups(longer, tails, self.n_ctx - len(head), self.option_seqs):
                # the previous group's option cells, in every sequence
                # (`LlamaContext.kv_cache_seq_rm` turns -1, "any sequence", into sequence 0)
                self._llama_cpp.llama_memory_seq_rm(ctx.memory, -1, len(head), -1)
                for seq in range(1, len(group)):
                    ctx.kv_cache_seq_cp(0, seq, 0, len(head))
                # Whole options, though their last token's logits are unused: a lone one-token
                # decode would take llama.cpp's single-row kernel, which rounds differently on
                # quantised weights (0.1 nat seen).
                bases = self._decode([(tails[k], seq, len(head), 0, len(tails[k]) - 1)
                                      for seq, k in enumerate(group)])
                for k, base in zip(group, bases):
                    tail = tails[k]
                    logp = self._log_probs(base, len(tail) - 1)
                    row[k] += float(logp[np.arange(len(tail) - 1), tail[1:]].sum())
            rows.append(row)
        return rows

    def _batch_context(self) -> tuple[Any, Any]:
        """The (context, batch) of `score` and `score_options`: n_ctx tokens per `llama_decode`,
        `score_seqs` KV sequences in one unified buffer, outputs only where a token's flag asks for
        them."""
        if self._packer is None:
            from llama_cpp import _internals

            params = self.engine.context_params  # the generation context's threads and n_ubatch
            ctx_params = type(params).from_buffer_copy(params)
            ctx_params.flash_attn_type = (self._llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                          else self._llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            # a pack (or one long pair) in one call
            ctx_params.n_ctx = ctx_params.n_batch = self.n_ctx
            # score's pack, score_options' options
            ctx_params.n_seq_max = max(self.score_seqs, self.option_seqs)
            ctx_params.kv_unified = True  # the pack's sequences share one KV buffer of n_ctx cells
            self._packer = (_internals.LlamaContext(model=self.engine._model, params=ctx_params, verbose=self.verbose),
                            _internals.LlamaBatch(n_tokens=self.n_ctx, embd=0, n_seq_max=1, verbose=self.verbose))
        return self._packer

    def _decode(self, pieces: list[tuple[list[int], int, int, int, int]]) -> list[int]:
        """One `llama_decode` of `pieces`, each (tokens, KV sequence, position of its first token,
        first and end index of the tokens whose logits are wanted); returns each piece's first index
        in the batch."""
        ctx, batch = self._batch_context()
        raw = batch.batch
        raw.n_tokens = 0
        bases = []
        for tokens, seq, start, lo, hi in pieces:
            base = raw.n_tokens
            for t, token in enumerate(tokens):
                j = base + t
                raw.token[j], raw.pos[j], raw.n_seq_id[j], raw.seq_id[j][0] = token, start + t, 1, seq
                raw.logits[j] = lo <= t < hi
            raw.n_tokens = base + len(tokens)
            bases.append(base)
        try:
            ctx.decode(batch)
        except RuntimeError as err:
            raise LLMBackendError(f"llama.cpp decode failed on {self.name}: {err}") from err
        return bases

    def _log_probs(self, first: int, count: int) -> np.ndarray:
        """Log-softmax (float64) of the logits at batch indices first .. first + count - 1 of the
        last decode."""
        n_vocab = self.engine.n_vocab()
        ctx = self._batch_context()[0]
        return _log_softmax(np.stack([np.ctypeslib.as_array(ctx.get_logits_ith(first + t), shape=(n_vocab,))
                                      for t in range(count)]).astype(np.float64))

    def close(self) -> None:
        for ctx in (self.engine, *(self._packer or ())):
            if ctx is not None and hasattr(ctx, "close"):
                ctx.close()
        self.engine = self._packer = None


def _option_groups(
    indices: list[int], tails: list[list[int]], room: int, max_seqs: int
) -> list[list[int]]:
    """`indices` cut, in order, into groups of at most `max_seqs` options whose tokens fit in `room`
    cells."""
    groups: list[list[int]] = []
    used = 0
    for k in indices:
        if not groups or len(groups[-1]) == max_seqs or used + len(tails[k]) > room:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += len(tails[k])
    return groups


def auto_weights(path: str, max_bytes: int = 1 << 30) -> str:
    """`f16` for a GGUF under `max_bytes` whose file type is Q4_1 (no fast batched CPU kernel), else
    `gguf`; `gguf` too when the file type cannot be read (the `gguf` package missing or no
    `general.file_type`)."""
    if os.path.getsize(path) > max_bytes:
        return "gguf"
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).fields["general.file_type"]
        file_type = int(field.parts[field.data[0]][0])
    except (ImportError, KeyError, IndexError, ValueError):
        return "gguf"
    return "f16" if file_type == _import_llama().LLAMA_FTYPE_MOSTLY_Q4_1 else "gguf"


def reencoded_gguf(
    source: ModelSource, weights: str, cache_dir: str | os.PathLike | None = None
) -> Path:
    """`source` re-encoded as `weights` by llama.cpp's quantizer, once:
    <cache>/llm/<name>-<digest>.<weights>.gguf, written to a temporary file and renamed (a killed
    conversion leaves nothing behind; two processes race harmlessly to the same bytes)."""
    llama_cpp = _import_llama()
    target = cache_root(cache_dir) / "llm" / f"{source.name}-{source.digest}.{weights}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    try:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, WEIGHT_TYPES[weights])
        # the source is already quantised; f32/f16/bf16 hold its values
        params.allow_requantize = True
        params.nthread = 1
        from llama_cpp._utils import suppress_stdout_stderr

        with suppress_stdout_stderr(disable=False):  # the quantizer prints every tensor
            failed = llama_cpp.llama_model_quantize(source.path.encode(), tmp.encode(), params)
        if failed:
            raise LLMBackendError(
                f"llama.cpp could not re-encode {source.path} as {weights} (code {failed})"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (as `score` computes it)."""
    logits = logits - logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
