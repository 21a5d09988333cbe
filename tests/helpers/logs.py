"""Small logs with the quirks of real ones, made in code so each quirk is visible where it is made.

- `news_log`: a news site's articles (link, headline, category, short_description, authors, date), newest first as
  such exports are: 29 categories, authors who favour a few of them, day-granular dates with several articles on
  one day, co-authored articles ("A, B"), articles without an author, articles without a description.
- `review_rows`: a product-review export (reviewerID, asin, overall, reviewText, summary, unixReviewTime): reviews
  with an empty text but a summary, several reviews of one user on one day, and, on one user's latest day, a review
  that quotes the review written just before it.
"""

from __future__ import annotations

import random
from datetime import date, datetime, timedelta, timezone

CATEGORIES = (
    "ARTS", "BUSINESS", "COLLEGE", "COMEDY", "CRIME", "DIVORCE", "EDUCATION", "ENTERTAINMENT", "ENVIRONMENT",
    "FOOD & DRINK", "GREEN", "HEALTHY LIVING", "HOME & LIVING", "IMPACT", "MEDIA", "MONEY", "PARENTING",
    "POLITICS", "RELIGION", "SCIENCE", "SPORTS", "STYLE & BEAUTY", "TASTE", "TECH", "TRAVEL", "WEDDINGS",
    "WEIRD NEWS", "WELLNESS", "WORLD NEWS",
)
_NOUNS = ("plan", "season", "report", "study", "debate", "festival", "market", "campaign", "trial", "record")
_PLACES = ("Ohio", "Lisbon", "the valley", "Nairobi", "the capital", "Osaka", "the coast", "Denver")


def _topic(category: str) -> str:
    """A category's own words, so a reader can tell categories apart."""
    word = category.split()[0].lower().strip("&")
    return {"arts": "gallery painting", "business": "merger profits", "college": "campus tuition",
            "comedy": "sketch stand-up", "crime": "police arrest", "divorce": "custody split",
            "education": "teachers school", "entertainment": "premiere celebrity", "environment": "climate river",
            "food": "recipe kitchen", "green": "recycling solar", "healthy": "exercise sleep",
            "home": "garden furniture", "impact": "charity volunteers", "media": "newsroom broadcast",
            "money": "savings mortgage", "parenting": "toddler bedtime", "politics": "senate election",
            "religion": "church faith", "science": "telescope genome", "sports": "playoff coach",
            "style": "fashion makeup", "taste": "chef tasting", "tech": "smartphone startup",
            "travel": "flight hotel", "weddings": "bride vows", "weird": "alligator mystery",
            "wellness": "meditation stress", "world": "embassy border"}[word]


def news_log(num_authors: int = 16, items: tuple[int, int] = (9, 14), seed: int = 0) -> list[dict]:
    """Rows of a news log, newest first (see the module docstring for its quirks)."""
    rng = random.Random(seed)
    authors = [f"Author {chr(65 + a % 26)}{a // 26} Writer" for a in range(num_authors)]
    rows: list[dict] = []
    for a, author in enumerate(authors):
        favourites = rng.sample(CATEGORIES, 2)
        day = date(2017, 1, 1) + timedelta(days=rng.randrange(60))
        for k in range(rng.randint(*items)):
            if k and rng.random() > 0.3:  # else a second article on the same day
                day += timedelta(days=rng.randint(1, 9))
            category = favourites[0] if rng.random() < 0.6 else favourites[1] if rng.random() < 0.7 else \
                rng.choice(CATEGORIES)
            names = author if rng.random() > 0.15 else f"{author}, {authors[(a + 1) % num_authors]}"
            rows.append(_article(rng, len(rows), category, names, day))
    for i, category in enumerate(CATEGORIES):  # every category in the log, some in articles without an author
        rows.append(_article(rng, len(rows), category, "" if i % 3 == 0 else authors[i % num_authors],
                             date(2017, 1, 1) + timedelta(days=i)))
    return sorted(rows, key=lambda r: (r["date"], r["link"]), reverse=True)


def _article(rng: random.Random, n: int, category: str, authors: str, day: date) -> dict:
    topic = _topic(category)
    description = "" if rng.random() < 0.1 else (f"What the {rng.choice(_NOUNS)} in {rng.choice(_PLACES)} means "
                                                  f"for {topic.split()[1]} this year.")
    return {"link": f"https://news.example/{n:05d}", "headline": f"The {topic} {rng.choice(_NOUNS)} of "
                                                                 f"{rng.choice(_PLACES)}",
            "category": category, "short_description": description, "authors": authors, "date": day.isoformat()}


QUOTED = "The SN-1 tuner locks onto weak stations and the dial is easy to read."
QUOTING = ("I wrote a review for the SN-1 which is essentially the same tuner: " + QUOTED + " The SN-2 adds a "
           "remote.")


def review_rows(num_users: int = 12, seed: int = 0) -> list[dict]:
    """Rows of a review export (see the module docstring for its quirks); user `AQUOTER` writes the quoting pair
    on their latest day (asins `B0SN1` and `B0SN2`)."""
    rng = random.Random(seed)
    rows = []
    for u in range(num_users):
        user = "AQUOTER" if u == 0 else f"A{u:04d}REVIEWER"
        day = date(2015, 3, 1) + timedelta(days=rng.randrange(30))
        for k in range(rng.randint(7, 10)):
            if k and rng.random() > 0.35:
                day += timedelta(days=rng.randint(1, 12))
            stars = rng.choice((5, 5, 5, 4, 4, 3, 2, 1))
            text = "" if (u + k) % 23 == 5 else f"Review {k} by {user}: {'great' if stars > 3 else 'poor'} value."
            rows.append(_review(user, f"B{u:03d}{k:03d}", stars, text, day))
        if user == "AQUOTER":
            rows += [_review(user, "B0SN1", 5, QUOTED, day + timedelta(days=3)),
                     _review(user, "B0SN2", 4, QUOTING, day + timedelta(days=3))]
    return rows


def _review(user: str, asin: str, stars: int, text: str, day: date) -> dict:
    moment = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    return {"reviewerID": user, "asin": asin, "overall": float(stars), "reviewText": text,
            "summary": f"{stars} stars", "unixReviewTime": int(moment.timestamp()),
            "reviewTime": moment.strftime("%m %d, %Y")}
