"""SynthLaMP's texts: the task prompts, the phrase vocabularies (``synth_vocab.json`` next to this
module) and the rendering of an item of (kind, slot tuple, style) into LaMP fields, a question's
input and its gold. A text is a function of its (kind, slots) alone, which is what keeps question
texts out of every history (synth_world.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from persrag_lightning.data.tasks import LAMP2_LABELS

__all__ = ["ABSTRACT_TEMPLATES", "ARTICLE_TEMPLATES", "CITATION_QUERY_TEMPLATES", "FILM_KINDS",
           "FILM_TEMPLATES", "HEADLINE_TEMPLATES", "LAMP2_PROMPT", "LAMP3_PROMPT", "LAMP3_SCORES",
           "LAMP4_PROMPT", "LAMP5_PROMPT", "PAPER_TITLE_TEMPLATES", "PRODUCT_KINDS",
           "REVIEW_TEMPLATES", "TOPICS", "TWEET_CLOSERS", "TWEET_OPENERS", "TWEET_TEMPLATES",
           "TWEET_TOPICS", "lamp1_variants", "render_item"]

LAMP2_PROMPT = (
    "Which tag does this movie relate to among the following tags? Just answer with the tag name "
    "without further explanation. tags: [" + ", ".join(LAMP2_LABELS) + "] description: "
)
LAMP3_PROMPT = ("What is the score of the following review on a scale of 1 to 5? just answer with 1, 2, 3, 4, or 5 "
                "without further explanation. review: ")
LAMP3_SCORES = ("1", "2", "3", "4", "5")
LAMP4_PROMPT = "Generate a headline for the following article: "
LAMP5_PROMPT = "Generate a title for the following abstract of a paper: "
LAMP1_PROMPT = (
    'For an author who has written the paper with the title "{title}", which reference is related? Just '
    'answer with [1] or [2] without explanation. [1]: "{reference1}" [2]: "{reference2}"'
)
LAMP1_LABELS = ("[1]", "[2]")
LAMP7_PROMPT = "Paraphrase the following tweet without any explanation before or after it: "



# ------------------------------------------------------------------------------------- vocabularies

@dataclass(frozen=True)
class FilmKind:
    """A kind of film: the tags communities may give it and the phrases its descriptions are made
    of."""

    name: str
    tags: tuple[str, ...]
    heroes: tuple[str, ...]
    goals: tuple[str, ...]
    settings: tuple[str, ...]
    twists: tuple[str, ...]


@dataclass(frozen=True)
class Topic:
    """A research topic: jargon alternatives (a community picks one for its titles, LaMP-4/5; the
    schools of LaMP-1) and abstract phrases."""

    name: str
    problems: tuple[str, ...]
    jargon: tuple[str, ...]
    contexts: tuple[str, ...]
    contributions: tuple[str, ...]
    data: tuple[str, ...]
    findings: tuple[str, ...]


@dataclass(frozen=True)
class ProductKind:
    """A product category (LaMP-3): neutral phrases a review of it is made of, the same for every
    community."""

    name: str
    products: tuple[str, ...]
    reasons: tuple[str, ...]
    details: tuple[str, ...]
    usages: tuple[str, ...]


@dataclass(frozen=True)
class TweetTopic:
    """A subject people tweet about (LaMP-7): content phrases shared by every community, and its
    hashtags (one per style)."""

    name: str
    subjects: tuple[str, ...]
    events: tuple[str, ...]
    details: tuple[str, ...]
    hashtags: tuple[str, ...]


# package data next to this module: the phrase tables texts are built from
VOCAB_FILE = "synth_vocab.json"


def _load_vocab() -> dict:
    """The vocabulary tables, read once at import from the package (a wheel ships the file, see
    pyproject)."""
    text = (
        resources.files("persrag_lightning.data").joinpath(VOCAB_FILE).read_text(encoding="utf-8")
    )
    return json.loads(text)


def _tuples(record: dict) -> dict:
    """JSON lists -> tuples, so the frozen dataclasses stay hashable and immutable."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}


_VOCAB = _load_vocab()
FILM_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["film_templates"])
FILM_KINDS: tuple[FilmKind, ...] = tuple(FilmKind(**_tuples(k)) for k in _VOCAB["film_kinds"])
ABSTRACT_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["abstract_templates"])
ARTICLE_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["article_templates"])
PAPER_TITLE_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["paper_title_templates"])
HEADLINE_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["headline_templates"])
TOPICS: tuple[Topic, ...] = tuple(Topic(**_tuples(t)) for t in _VOCAB["topics"])
REVIEW_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["review_templates"])
PRODUCT_KINDS: tuple[ProductKind, ...] = tuple(
    ProductKind(**_tuples(k)) for k in _VOCAB["product_kinds"]
)
CITATION_QUERY_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["citation_query_title_templates"])
CITATION_TITLE_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["citation_title_templates"])
CITATION_ABSTRACT_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["citation_abstract_templates"])
CITATION_REFERENCE_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["citation_reference_templates"])
TWEET_TEMPLATES: tuple[str, ...] = tuple(_VOCAB["tweet_templates"])
TWEET_OPENERS: tuple[str, ...] = tuple(_VOCAB["tweet_openers"])
TWEET_CLOSERS: tuple[str, ...] = tuple(_VOCAB["tweet_closers"])
TWEET_TOPICS: tuple[TweetTopic, ...] = tuple(
    TweetTopic(**_tuples(t)) for t in _VOCAB["tweet_topics"]
)
del _VOCAB

_SMALL_WORDS = {"a", "an", "and", "at", "by", "for", "from", "in", "is", "of", "on", "the", "to", "via", "with"}


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _title_case(phrase: str) -> str:
    """Headline capitalisation: every word capitalised except short function words after the
    first."""
    words = phrase.split()
    return " ".join(w if i and w in _SMALL_WORDS else _cap(w) for i, w in enumerate(words))


def _check_vocabularies() -> None:
    """Every kind must have equally long phrase lists, so slot indices can be drawn for all kinds at
    once."""
    for kinds, attrs in (
        (FILM_KINDS, ("heroes", "goals", "settings", "twists")),
        (TOPICS, ("problems", "jargon", "contexts", "contributions", "data", "findings")),
        (PRODUCT_KINDS, ("products", "reasons", "details", "usages")),
        (TWEET_TOPICS, ("subjects", "events", "details", "hashtags")),
    ):
        for a in attrs:
            sizes = {len(getattr(k, a)) for k in kinds}
            assert len(sizes) == 1, f"{a}: unequal list lengths {sizes}"
    for kind in FILM_KINDS:
        assert set(kind.tags) <= set(LAMP2_LABELS), kind.name
    assert set().union(*(k.tags for k in FILM_KINDS)) == set(LAMP2_LABELS), (
        "every LaMP-2 label must be reachable"
    )
    # LaMP-1: a question title holds the problem, data and contribution; the history abstract one
    # finding per contribution; a tweet style is an opener, a closer and a hashtag of the same index
    assert len(CITATION_TITLE_TEMPLATES) == len(CITATION_ABSTRACT_TEMPLATES) == len(CITATION_QUERY_TEMPLATES)
    assert len(TOPICS[0].findings) == len(TOPICS[0].contributions) and len(TOPICS[0].jargon) >= 2
    assert len(TWEET_OPENERS) == len(TWEET_CLOSERS) == len(TWEET_TOPICS[0].hashtags)


_check_vocabularies()



# --------------------------------------------------------------------------------------------- text

def _film_fields(kind: int, slots: Sequence[int], style: int) -> tuple[str, str]:
    """(description, tag) of a film of `kind`; the tag is the style."""
    k = FILM_KINDS[kind]
    hero, goal, setting, twist = k.heroes[slots[1]], k.goals[slots[2]], k.settings[slots[3]], k.twists[slots[4]]
    text = FILM_TEMPLATES[slots[0]].format(
        Hero=_cap(hero), hero=hero, goal=goal, Setting=_cap(setting), setting=setting, twist=twist
    )
    return text, LAMP2_LABELS[style]


def _paper_fields(task: str, kind: int, slots: Sequence[int], style: int) -> tuple[str, str]:
    """(body, title) on a topic: the body from the topic's phrases, the title in the community's
    style."""
    t = TOPICS[kind]
    problem = t.problems[slots[1]]
    bodies = ABSTRACT_TEMPLATES if task == "LaMP-5" else ARTICLE_TEMPLATES
    titles = PAPER_TITLE_TEMPLATES if task == "LaMP-5" else HEADLINE_TEMPLATES
    body = bodies[slots[0]].format(Problem=_cap(problem), problem=problem, context=t.contexts[slots[2]],
                                   contribution=t.contributions[slots[3]], data=t.data[slots[4]],
                                   finding=t.findings[slots[5]])
    n_jargon = len(t.jargon)
    title = titles[style // n_jargon].format(
        J=_title_case(t.jargon[style % n_jargon]), P=_title_case(problem)
    )
    return body, title


def _review_text(kind: int, slots: Sequence[int]) -> str:
    """A neutral review of a product of category `kind` (LaMP-3): nothing in it depends on the
    score."""
    p = PRODUCT_KINDS[kind]
    detail = p.details[slots[3]]
    return REVIEW_TEMPLATES[slots[0]].format(product=p.products[slots[1]], reason=p.reasons[slots[2]],
                                             Detail=_cap(detail), detail=detail, usage=p.usages[slots[4]])


def lamp1_variants() -> int:
    """How many ways a LaMP-1 question can present its references: which of them is the gold one
    (2), the other reference's school (any but the gold's) and the reference title template."""
    return 2 * (len(TOPICS[0].jargon) - 1) * len(CITATION_REFERENCE_TEMPLATES)


def _citation_fields(
    kind: int, slots: Sequence[int], style: int, variant: int
) -> tuple[dict[str, str], str, str]:
    """LaMP-1: (the paper as a profile item, the question about it, the gold choice). A paper is
    (topic, slots): as a history item its title and abstract are written in `style`'s school; as a
    question its title names no school (the query), and the two references are on the paper's
    problem in the same template, one in the community's school (`style`) and one in another
    (`variant` picks which other, the template, and the gold's position)."""
    t = TOPICS[kind]
    template, problem, contribution, data = slots[0], t.problems[slots[1]], t.contributions[slots[2]], t.data[slots[3]]
    finding, school = t.findings[slots[2]], t.jargon[style]
    fields = {"title": CITATION_TITLE_TEMPLATES[template].format(J=_title_case(school), P=_title_case(problem)),
              "abstract": CITATION_ABSTRACT_TEMPLATES[template].format(
                  Problem=_cap(problem), problem=problem, school=school, contribution=contribution, data=data,
                  finding=finding)}
    title = CITATION_QUERY_TEMPLATES[template].format(P=_title_case(problem), D=_title_case(data),
                                                      C=_title_case(contribution))
    n_schools = len(t.jargon)
    gold_first, rest = variant % 2 == 0, variant // 2
    other = (style + 1 + rest % (n_schools - 1)) % n_schools
    reference = CITATION_REFERENCE_TEMPLATES[
        rest // (n_schools - 1) % len(CITATION_REFERENCE_TEMPLATES)
    ]
    gold, wrong = (
        reference.format(J=_title_case(t.jargon[s]), P=_title_case(problem)) for s in (style, other)
    )
    first, second = (gold, wrong) if gold_first else (wrong, gold)
    text = LAMP1_PROMPT.format(title=title, reference1=first, reference2=second)
    return fields, text, LAMP1_LABELS[0 if gold_first else 1]


def _tweet_fields(kind: int, slots: Sequence[int], style: int) -> tuple[str, str]:
    """LaMP-7: (the neutral tweet, the same content in `style`: opener, content, closer, topic
    hashtag)."""
    t = TWEET_TOPICS[kind]
    subject = t.subjects[slots[1]]
    neutral = TWEET_TEMPLATES[slots[0]].format(
        Subject=_cap(subject), subject=subject, event=t.events[slots[2]], detail=t.details[slots[3]]
    )
    styled = f"{TWEET_OPENERS[style]} {neutral[:1].lower()}{neutral[1:]} {TWEET_CLOSERS[style]} {t.hashtags[style]}"
    return neutral, styled


def render_item(task: str, kind: int, slots: Sequence[int], style: int,
                variant: int = 0) -> tuple[dict[str, str], str, str]:
    """(profile fields, question input, target) of one item; questions and history share the
    generator. `variant` (LaMP-1 questions only) is how the references are presented, drawn per
    question."""
    if task == "LaMP-1":
        return _citation_fields(kind, slots, style, variant)
    if task == "LaMP-7":
        neutral, styled = _tweet_fields(kind, slots, style)
        return {"text": styled}, LAMP7_PROMPT + neutral, styled
    if task == "LaMP-2":
        description, tag = _film_fields(kind, slots, style)
        return {"description": description, "tag": tag}, LAMP2_PROMPT + description, tag
    if task == "LaMP-3":
        text, score = _review_text(kind, slots), LAMP3_SCORES[style]
        return {"text": text, "score": score}, LAMP3_PROMPT + text, score
    body, title = _paper_fields(task, kind, slots, style)
    if task == "LaMP-5":
        return {"title": title, "abstract": body}, LAMP5_PROMPT + body, title
    return {"text": body, "title": title}, LAMP4_PROMPT + body, title

