"""SynthLaMP's latent world: the config, the communities' tastes and styles it draws, the fixed
partition of slot tuples into question and history sides, and the draws of users' histories (kinds
and styles, no text yet)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from persrag_lightning.data.synth_text import (
    ABSTRACT_TEMPLATES,
    ARTICLE_TEMPLATES,
    CITATION_QUERY_TEMPLATES,
    FILM_KINDS,
    FILM_TEMPLATES,
    HEADLINE_TEMPLATES,
    LAMP3_SCORES,
    PAPER_TITLE_TEMPLATES,
    PRODUCT_KINDS,
    REVIEW_TEMPLATES,
    TOPICS,
    TWEET_CLOSERS,
    TWEET_OPENERS,
    TWEET_TEMPLATES,
    TWEET_TOPICS,
)
from persrag_lightning.data.tasks import LAMP2_LABELS, get_task

__all__ = ["DEFAULT_USERS", "QUESTIONS_PER_USER", "SYNTH_TASKS", "SynthConfig", "SynthWorld", "build_world", "draw_histories",
           "draw_slots"]

SYNTH_TASKS = ("LaMP-1", "LaMP-2", "LaMP-3", "LaMP-4", "LaMP-5", "LaMP-7")
# one slot tuple in QUESTION_SHARE (by hash) may only be a question, the rest only history
QUESTION_SHARE = 4
# rejection rounds; a question row fails a round with p ~ 3/4, so 256 never run out in practice
MAX_REDRAWS = 256
# the default dataset's size: its users, and each user's questions per split in time order (SynthConfig's
# defaults; a plan reads them without building and validating a config)
DEFAULT_USERS = 300
QUESTIONS_PER_USER = {"train": 2, "dev": 1, "test": 1}


# ------------------------------------------------------------------------------------------- config

@dataclass
class SynthConfig:
    """Size and difficulty of a SynthLaMP dataset; equal configs give byte-identical files. Question
    texts never occur in any history (see data/synth.py's module docstring).

    Args:
        task: the LaMP task to generate (LaMP-1, -2, -3, -4, -5 or -7).
        num_users: users in the dataset.
        num_communities: communities of users that share tastes; collaborative retrieval finds a
            user's peers among them.
        docs_per_user: (min, max) range of a user's history length, drawn per user.
        kinds_per_user: (min, max) range of how many kinds (genres, topics) a user's history covers.
        train_questions_per_user: train questions per user; the splits follow each other in time.
        dev_questions_per_user: dev questions per user (checkpoints are selected on them).
        test_questions_per_user: test questions per user; 1 so that results are reported on data no
            checkpoint was selected on (0 omits the test files).
        unseen_fraction: share of questions on a kind the user's history lacks (answerable only from
            same-community users).
        noise: share of history items in another community's or a random style.
        seed: the generator's seed.
    """

    task: str = "LaMP-2"
    num_users: int = DEFAULT_USERS
    num_communities: int = 8
    docs_per_user: tuple[int, int] = (20, 60)
    kinds_per_user: tuple[int, int] = (3, 5)
    train_questions_per_user: int = QUESTIONS_PER_USER["train"]
    dev_questions_per_user: int = QUESTIONS_PER_USER["dev"]
    test_questions_per_user: int = QUESTIONS_PER_USER["test"]
    unseen_fraction: float = 0.6
    noise: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        """Normalise the task name and tuples (configs come from YAML/JSON too) and reject
        impossible sizes."""
        self.task = get_task(self.task).name
        if self.task not in SYNTH_TASKS:
            raise ValueError(
                f"SynthLaMP generates {', '.join(SYNTH_TASKS)}; got task {self.task!r}"
            )
        self.docs_per_user = (int(self.docs_per_user[0]), int(self.docs_per_user[1]))
        self.kinds_per_user = (int(self.kinds_per_user[0]), int(self.kinds_per_user[1]))
        num_kinds = {"LaMP-2": len(FILM_KINDS), "LaMP-3": len(PRODUCT_KINDS),
                     "LaMP-7": len(TWEET_TOPICS)}.get(self.task, len(TOPICS))
        if self.num_users < 1 or self.num_communities < 1:
            raise ValueError("num_users and num_communities must be >= 1")
        if not 1 <= self.docs_per_user[0] <= self.docs_per_user[1]:
            raise ValueError(
                f"docs_per_user must be (lo, hi) with 1 <= lo <= hi, got {self.docs_per_user}"
            )
        if not 1 <= self.kinds_per_user[0] <= self.kinds_per_user[1] < num_kinds:
            raise ValueError(
                f"kinds_per_user must be (lo, hi) with 1 <= lo <= hi < {num_kinds} (the number of "
                f"kinds of {self.task}), got {self.kinds_per_user}"
            )
        if self.train_questions_per_user < 1 or min(self.dev_questions_per_user, self.test_questions_per_user) < 0:
            raise ValueError("need train_questions_per_user >= 1 and non-negative dev/test counts")
        if not (0.0 <= self.unseen_fraction <= 1.0 and 0.0 <= self.noise <= 1.0):
            raise ValueError("unseen_fraction and noise must lie in [0, 1]")

    def questions_per_split(self) -> dict[str, int]:
        """Questions per user of each split, in time order (train before dev before test)."""
        return {"train": self.train_questions_per_user, "dev": self.dev_questions_per_user,
                "test": self.test_questions_per_user}


# -------------------------------------------------------------------------------------------- world

@dataclass(frozen=True)
class SynthWorld:
    """The latent truth of a config: community tastes over kinds and each community's style per
    kind."""

    task: str
    kind_names: tuple[str, ...]
    num_styles: int
    # (communities, kinds): LaMP-2 label index, LaMP-3 score - 1, LaMP-1 school (jargon index),
    # LaMP-7 style index, or template * n_jargon + jargon (LaMP-4/5)
    styles: np.ndarray
    # (communities, kinds): how often a community's users have items of each kind
    kind_pref: np.ndarray
    slot_sizes: tuple[int, ...]  # sizes of the random text slots (template first)

    def style_name(self, style: int) -> str:
        """Readable form of a style, for diagnostics."""
        if self.task == "LaMP-2":
            return LAMP2_LABELS[style]
        if self.task == "LaMP-3":
            return f"score {LAMP3_SCORES[style]}"
        if self.task == "LaMP-1":
            return f"school #{style}"
        if self.task == "LaMP-7":
            return f"style #{style} ({TWEET_OPENERS[style]} ... {TWEET_CLOSERS[style]})"
        n_jargon = len(TOPICS[0].jargon)
        return f"template {style // n_jargon}, jargon #{style % n_jargon}"


def build_world(config: SynthConfig) -> SynthWorld:
    """Draw the communities' tastes and styles from the config's seed (stream 0)."""
    rng = np.random.default_rng([config.seed, 0])
    return _WORLD_OF_TASK.get(config.task, _topic_world)(config, rng)


def _taste(rng: np.random.Generator, communities: int, kinds: int) -> np.ndarray:
    """A taste per community over the kinds, with every kind still possible."""
    return 0.5 * rng.dirichlet(np.ones(kinds), size=communities) + 0.5 / kinds


def _uniform_taste(communities: int, kinds: int) -> np.ndarray:
    """Every community has items of every kind equally often."""
    return np.full((communities, kinds), 1.0 / kinds)


def _film_world(config: SynthConfig, rng: np.random.Generator) -> SynthWorld:
    """LaMP-2: each community tags each kind of film with one of that kind's tags."""
    c = config.num_communities
    kinds = FILM_KINDS
    label_index = {label: i for i, label in enumerate(LAMP2_LABELS)}
    styles = np.array(
        [[label_index[k.tags[rng.integers(len(k.tags))]] for k in kinds] for _ in range(c)]
    )
    slots = (len(FILM_TEMPLATES), len(kinds[0].heroes), len(kinds[0].goals), len(kinds[0].settings),
             len(kinds[0].twists))
    names = tuple(k.name for k in kinds)
    return SynthWorld(config.task, names, len(LAMP2_LABELS), styles.astype(np.int64),
                      _taste(rng, c, len(names)), slots)


def _review_world(config: SynthConfig, rng: np.random.Generator) -> SynthWorld:
    """LaMP-3: communities differ only in judgments.

    Each rates every category its own way (1-5, uniform), and every community reviews every category
    equally often (uniform taste), so which categories a user reviews, like the neutral words of the
    reviews, says nothing about the community."""
    c, k = config.num_communities, len(PRODUCT_KINDS)
    styles = rng.integers(0, len(LAMP3_SCORES), (c, k))
    p0 = PRODUCT_KINDS[0]
    slots = (len(REVIEW_TEMPLATES), len(p0.products), len(p0.reasons), len(p0.details), len(p0.usages))
    return SynthWorld(config.task, tuple(p.name for p in PRODUCT_KINDS), len(LAMP3_SCORES),
                      styles.astype(np.int64), _uniform_taste(c, k), slots)


def _citation_world(config: SynthConfig, rng: np.random.Generator) -> SynthWorld:
    """LaMP-1: communities differ only in judgment, as for LaMP-3.

    Per topic each follows one school (a jargon entry), and every community writes on every topic
    equally often, so only the schools name the community."""
    c, k, t0 = config.num_communities, len(TOPICS), TOPICS[0]
    styles = rng.integers(0, len(t0.jargon), (c, k))
    slots = (len(CITATION_QUERY_TEMPLATES), len(t0.problems), len(t0.contributions), len(t0.data))
    return SynthWorld(config.task, tuple(t.name for t in TOPICS), len(t0.jargon), styles.astype(np.int64),
                      _uniform_taste(c, k), slots)


def _tweet_world(config: SynthConfig, rng: np.random.Generator) -> SynthWorld:
    """LaMP-7: per topic a community tweets in one style (opener, closer, hashtag) around content
    shared by all; every community tweets on every topic equally often."""
    c, k, t0 = config.num_communities, len(TWEET_TOPICS), TWEET_TOPICS[0]
    styles = rng.integers(0, len(TWEET_OPENERS), (c, k))
    slots = (len(TWEET_TEMPLATES), len(t0.subjects), len(t0.events), len(t0.details))
    return SynthWorld(config.task, tuple(t.name for t in TWEET_TOPICS), len(TWEET_OPENERS),
                      styles.astype(np.int64), _uniform_taste(c, k), slots)


def _topic_world(config: SynthConfig, rng: np.random.Generator) -> SynthWorld:
    """LaMP-4/5: each community writes each topic with its own title template and jargon."""
    c = config.num_communities
    templates = PAPER_TITLE_TEMPLATES if config.task == "LaMP-5" else HEADLINE_TEMPLATES
    t0 = TOPICS[0]
    n_jargon = len(t0.jargon)
    styles = rng.integers(0, len(templates), (c, len(TOPICS))) * n_jargon + rng.integers(
        0, n_jargon, (c, len(TOPICS))
    )
    num_styles = len(templates) * n_jargon
    body = ABSTRACT_TEMPLATES if config.task == "LaMP-5" else ARTICLE_TEMPLATES
    slots = (len(body), len(t0.problems), len(t0.contexts), len(t0.contributions), len(t0.data),
             len(t0.findings))
    names = tuple(t.name for t in TOPICS)
    return SynthWorld(config.task, names, num_styles, styles.astype(np.int64), _taste(rng, c, len(names)), slots)


# the world of each task, drawn from stream 0; the other tasks (LaMP-4/5) are _topic_world's
_WORLD_OF_TASK = {"LaMP-2": _film_world, "LaMP-3": _review_world, "LaMP-1": _citation_world,
                  "LaMP-7": _tweet_world}



# ---------------------------------------------------------------------------------------- histories

def is_question_tuple(kind: np.ndarray, slots: np.ndarray, slot_sizes: Sequence[int]) -> np.ndarray:
    """Whether each (kind, slot tuple) row belongs to the question side of the fixed partition.

    A pure function of the tuple (splitmix64 of its index in the task's slot space), independent of
    seed, chunk and user, so every chunk keeps the sides apart on its own. Texts are injective in
    (kind, slots) (a test renders all of them), hence disjoint tuples mean disjoint texts."""
    sizes = np.asarray(slot_sizes, dtype=np.int64)
    index = kind.astype(np.uint64) * np.uint64(int(sizes.prod())) + np.ravel_multi_index(
        tuple(np.asarray(slots, dtype=np.int64).T), tuple(sizes)).astype(np.uint64)
    z = index + np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap around, as the mixer wants
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) % np.uint64(QUESTION_SHARE) == 0


def draw_slots(rng: np.random.Generator, redraw_rng: np.random.Generator, slot_sizes: Sequence[int],
                kind: np.ndarray, question: bool) -> np.ndarray:
    """Uniform slot tuples for items of `kind`, restricted to the question or history side by
    redrawing rows.

    The first draw takes the same numbers from `rng` as ``synthlamp/1`` did and redraws come from
    their own stream, so for a given config every other draw (communities, kinds, styles, dates,
    unseen flags) is unchanged and a tuple that was already on its side stays as it was. The one
    change of distribution: each side is uniform over its own part of the space (about
    1/QUESTION_SHARE of tuples for questions) instead of over all of it."""
    slots = rng.integers(0, slot_sizes, size=(len(kind), len(slot_sizes)))
    redraw = np.flatnonzero(is_question_tuple(kind, slots, slot_sizes) != question)
    for _ in range(MAX_REDRAWS):
        if not len(redraw):
            return slots
        slots[redraw] = redraw_rng.integers(0, slot_sizes, size=(len(redraw), len(slot_sizes)))
        redraw = redraw[is_question_tuple(kind[redraw], slots[redraw], slot_sizes) != question]
    raise RuntimeError(
        "slot redraws did not converge; is one side of the slot partition empty for some kind?"
    )


@dataclass
class HistoryDraws:
    """The (kind, style) of every history item of n users, items of user u at rows
    starts[u]:starts[u]+n_docs[u], oldest first; `order` is each user's kinds by taste, the first
    n_seen[u] seen."""

    comm: np.ndarray
    n_docs: np.ndarray
    n_seen: np.ndarray
    order: np.ndarray
    starts: np.ndarray
    owner: np.ndarray
    kind: np.ndarray
    style: np.ndarray
    noisy: np.ndarray


def draw_histories(
    rng: np.random.Generator, config: SynthConfig, world: SynthWorld, n: int
) -> HistoryDraws:
    """The first draws of a chunk: each user's community, history length, kinds and each item's kind
    and style (benchmarks/bench_retrieval.py draws a million users' histories this way without
    rendering any text)."""
    c_count, k_count = world.styles.shape
    comm = rng.integers(0, c_count, n)
    n_docs = rng.integers(config.docs_per_user[0], config.docs_per_user[1] + 1, n)
    n_seen = np.minimum(
        rng.integers(config.kinds_per_user[0], config.kinds_per_user[1] + 1, n), n_docs
    )
    # Gumbel-top-k: each row is the kinds in an order drawn from the community's taste; the first
    # n_seen are seen.
    order = np.argsort(
        -(np.log(world.kind_pref[comm]) + rng.gumbel(size=(n, k_count))), axis=1, kind="stable"
    )

    # History items: the first n_seen cover each seen kind once, the rest pick a seen kind at
    # random.
    total = int(n_docs.sum())
    owner = np.repeat(np.arange(n), n_docs)
    starts = np.cumsum(n_docs) - n_docs
    pos = np.arange(total) - starts[owner]
    pick = np.where(pos < n_seen[owner], pos, (rng.random(total) * n_seen[owner]).astype(np.int64))
    kind = order[owner, pick]
    other = (comm[owner] + rng.integers(1, max(c_count, 2), total)) % c_count
    noisy = rng.random(total) < config.noise
    style = np.where(noisy, np.where(rng.random(total) < 0.5, world.styles[other, kind],
                                     rng.integers(0, world.num_styles, total)), world.styles[comm[owner], kind])
    return HistoryDraws(comm, n_docs, n_seen, order, starts, owner, kind, style, noisy)

