"""Simulated conversations with planted facts and later questions about them, and recall@k of the
planted
memory: the seed evaluated its memory with three anecdotes; this counts, over many users who all
share the same kinds of facts (so another user's memory is the most tempting wrong answer)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from persrag_lightning.memory.bank import MemoryBank
from persrag_lightning.progress import Progress

__all__ = ["SimulatedConversation", "feed_conversations", "measure_recall",
           "questionnaire_answers", "simulate_conversations"]

# (slot, statement, question, values): every user gets a different value of the same slots.
FACT_TEMPLATES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("pet", "By the way, my dog is called {v}.", "What is my dog called?",
     ("Biscuit", "Luna", "Pepper", "Ziggy", "Mochi", "Waffles")),
    ("city", "I moved to {v} last spring and I live there now.", "Which city do I live in now?",
     ("Lisbon", "Osaka", "Montreal", "Nairobi", "Tallinn", "Valparaiso")),
    ("job", "I work as a {v} at a small company.", "What do I work as?",
     ("nurse", "carpenter", "data engineer", "pharmacist", "translator", "pilot")),
    ("language", "My favourite programming language is {v}.", "Which programming language is my favourite?",
     ("Rust", "Haskell", "Python", "Kotlin", "Elixir", "Julia")),
    ("allergy", "I am allergic to {v}, so keep that in mind for recipes.", "Which food am I allergic to?",
     ("peanuts", "shellfish", "gluten", "sesame", "kiwi", "eggs")),
    ("sport", "On weekends I play {v} with friends.", "What do I play on weekends?",
     ("badminton", "volleyball", "chess", "rugby", "tennis", "cricket")),
    ("risk", "I prefer {v} investment strategies.", "What investment strategies do I prefer?",
     ("high-risk", "low-risk", "index-only", "dividend-focused", "ethical", "aggressive growth")),
)
FILLERS: tuple[str, ...] = (
    "Can you explain how photosynthesis works?",
    "Write a haiku about autumn rain.",
    "What is the difference between TCP and UDP?",
    "Summarise the causes of the French Revolution in three lines.",
    "How do I reverse a linked list?",
    "Give me a tip for sleeping better.",
    "What does a p-value mean?",
    "Translate 'good morning' into Spanish.",
)


# More unrelated requests for long conversations: every (request, subject) pair is a distinct
# message.
FILLER_REQUESTS: tuple[str, ...] = (
    "Can you explain {s} in simple terms?", "Give me three facts about {s}.", "Write a short poem about {s}.",
    "What are common misconceptions about {s}?", "Summarise the history of {s} in two lines.",
    "How would you teach {s} to a child?", "List the pros and cons of {s}.", "What is a good book about {s}?",
)
FILLER_SUBJECTS: tuple[str, ...] = (
    "black holes", "the stock market", "volcanoes", "machine translation", "the Roman empire", "bees",
    "quantum computing", "jazz harmony", "glaciers", "the printing press", "compilers", "coral reefs",
    "impressionist painting", "vaccines", "the Silk Road", "tides", "chess openings", "solar panels",
    "the immune system", "origami", "desert ecosystems", "the Cold War", "recursion", "coffee roasting",
    "earthquakes", "the violin",
)
# Sign-up answers of the seed's five questionnaire categories (memory/extract.py QUESTIONNAIRE), one
# drawn each.
QUESTIONNAIRE_ANSWERS: dict[str, tuple[str, ...]] = {
    "interaction_style": ("Be brief and direct, like a colleague.", "Explain patiently, like a tutor.",
                          "Challenge my ideas like a critic would."),
    "professional_background": ("I am a high-school teacher of biology.", "I am a backend developer.",
                                "I run a small bakery.", "I am a hospital administrator."),
    "learning": ("I am learning Spanish, best with flashcards.", "I study statistics from textbooks.",
                 "I am learning the guitar from videos."),
    "hobbies_lifestyle": ("I go climbing twice a week and cook at home.", "I garden and read crime novels.",
                          "I travel a lot and photograph cities."),
    "goals": ("I want to change careers within two years.", "I want to run a marathon next year.",
              "I want to publish a novel."),
}


def _filler_messages(n: int, rng: random.Random) -> list[str]:
    """`n` distinct unrelated requests (the short list first, then request x subject pairs), in
    random order.

    Args:
        n: how many requests.
        rng: the seeded generator of the order.
    """
    pool = list(FILLERS) + [r.format(s=s) for r in FILLER_REQUESTS for s in FILLER_SUBJECTS]
    if n > len(pool):
        raise ValueError(f"at most {len(pool)} distinct filler messages, asked for {n}")
    return rng.sample(pool, n)


def questionnaire_answers(rng: random.Random) -> dict[str, str]:
    """One seeded answer per questionnaire category (the sign-up memories the seed starts a user
    with).

    Args:
        rng: the seeded generator of the answers.
    """
    return {category: rng.choice(answers) for category, answers in QUESTIONNAIRE_ANSWERS.items()}


@dataclass(frozen=True)
class PlantedFact:
    """A fact told once in a conversation, and the later question whose answer is `value`."""

    slot: str
    statement: str
    question: str
    value: str


@dataclass(frozen=True)
class SimulatedConversation:
    """One user's session: facts interleaved with unrelated requests, then questions about every
    fact."""

    user_id: str
    session_id: str
    messages: tuple[str, ...]
    facts: tuple[PlantedFact, ...]


@dataclass(frozen=True)
class RecallReport:
    """recall@k: share of questions whose planted memory is among the recalled ones; MRR over the
    same; `foreign`: recalled memories of another user (must be 0)."""

    k: int
    questions: int
    hits: int
    recall_at_k: float
    mrr: float
    foreign: int
    fallbacks: int
    repaired: int


def simulate_conversations(n_users: int, facts_per_user: int = 3, fillers_per_fact: int = 2,
                           seed: int = 0) -> list[SimulatedConversation]:
    """Seeded conversations; each user gets `facts_per_user` distinct slots with random values."""
    if not 1 <= facts_per_user <= len(FACT_TEMPLATES):
        raise ValueError(
            f"facts_per_user must be in 1..{len(FACT_TEMPLATES)}, got {facts_per_user}"
        )
    rng = random.Random(seed)
    out = []
    for u in range(n_users):
        facts = []
        for slot, statement, question, values in rng.sample(FACT_TEMPLATES, facts_per_user):
            v = rng.choice(values)
            facts.append(PlantedFact(slot, statement.format(v=v), question, v))
        messages: list[str] = []
        fillers = _filler_messages(fillers_per_fact * facts_per_user, rng) if fillers_per_fact > len(FILLERS) \
            else None
        for i, f in enumerate(facts):
            messages.append(f.statement)
            messages.extend(rng.sample(FILLERS, fillers_per_fact) if fillers is None
                            else fillers[i * fillers_per_fact:(i + 1) * fillers_per_fact])
        out.append(SimulatedConversation(f"sim-user-{u}", f"sim-session-{u}", tuple(messages), tuple(facts)))
    return out


def feed_conversations(bank: MemoryBank, conversations: list[SimulatedConversation],
                       signup: dict[str, dict[str, str]] | None = None) -> None:
    """Each user's questionnaire sign-up (when `signup` has it), then every message through
    `remember` (one LLM extraction each on the seed's path: a progress line with an ETA every 10
    s)."""
    bar = Progress("remember messages", sum(len(c.messages) for c in conversations), "messages", final="if_long")
    for conv in conversations:
        if signup and conv.user_id in signup:
            bank.add_user(conv.user_id, signup[conv.user_id])
        for message in conv.messages:
            bank.remember(conv.user_id, message, conv.session_id)
            bar.advance()


def measure_recall(bank: MemoryBank, conversations: list[SimulatedConversation],
                   signup: dict[str, dict[str, str]] | None = None) -> RecallReport:
    """Feed every conversation through `remember` (after the user's questionnaire sign-up, when
    `signup` has it), then ask every question through `recall`; a hit is a recalled memory of the
    same user that contains the planted value."""
    feed_conversations(bank, conversations, signup)
    hits = foreign = questions = 0
    rr = 0.0
    for conv in conversations:
        for fact in conv.facts:
            questions += 1
            recalled = bank.recall(conv.user_id, fact.question, session_id=conv.session_id)
            foreign += sum(r.memory.user_id != conv.user_id for r in recalled)
            for pos, r in enumerate(recalled, start=1):
                if r.memory.user_id == conv.user_id and fact.value.lower() in r.memory.text.lower():
                    hits += 1
                    rr += 1.0 / pos
                    break
    return RecallReport(k=bank.settings.recall.k, questions=questions, hits=hits,
                        recall_at_k=hits / questions if questions else 0.0, mrr=rr / questions if questions else 0.0,
                        foreign=foreign, fallbacks=bank.fallbacks, repaired=bank.repaired)
