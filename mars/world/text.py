"""Names, facts and corpus documents of the generated world.

Everything here is a pure function of a ``numpy.random.Generator`` (or of plain values), so the
same seed always yields the same names and the same documents:

- :func:`make_word` draws a pronounceable word from syllables ("Varnell", "Tesmora");
- :func:`make_facts` draws the facts of one entity (kind, founding year, city, founder);
- :func:`distractor_name` derives a similar name (one letter changed, or a shared word);
- :func:`entity_documents` writes the short documents that state an entity's facts (what
  ``text_search`` searches), with eight sentence templates that word each fact differently
  ("established in X", "based in X", "Located in X"), as real web and Wikipedia text does. (Plainer
  wordings, each fact after one fixed cue or one fact per document, were measured no easier for the
  tiny reader: docs/findings.md.)

Try it: ``python -m mars.world.text`` prints a few names and one document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ONSETS: tuple[str, ...] = (
    "b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p",
    "pr", "r", "s", "st", "t", "tr", "v", "w", "z", "th", "sh", "qu",
)
VOWELS: tuple[str, ...] = ("ai", "ea", "ou", "io", "ei", "au")  # rare diphthongs
CODAS: tuple[str, ...] = ("", "", "", "n", "r", "l", "s", "th", "nd", "rn", "ll", "m", "x", "sk")

KINDS: tuple[str, ...] = (
    "observatory", "guild", "foundry", "academy", "brewery", "orchestra", "library",
    "shipyard", "institute", "society", "company", "museum", "conservatory", "mill",
    "press", "workshop", "garden", "archive", "club", "bank", "theatre", "college",
)
CITY_SUFFIXES: tuple[str, ...] = ("", "", "port", "ford", "haven", "burg", "ton", "vale", "mouth")
VOWEL_LETTERS = "aeiou"
CONSONANT_LETTERS = "bcdfghklmnprstvwz"

YEAR_MIN = 1650
YEAR_MAX = 2015


@dataclass(frozen=True)
class Facts:
    """The facts of one entity; none of them can be read off its emblem."""

    kind: str
    founded_year: int
    city: str
    founder: str


def make_word(rng: np.random.Generator, syllables: tuple[int, int] = (2, 3)) -> str:
    """A capitalised pronounceable word of ``syllables[0]..syllables[1]`` syllables, 4-9 letters.

    Syllables alternate consonants and vowels: a syllable after one that ends in a vowel always
    starts with a consonant, and diphthongs are rare, so words read like "Varnell" or "Tesmora".
    """
    while True:
        n = int(rng.integers(syllables[0], syllables[1] + 1))
        word = ""
        for i in range(n):
            needs_onset = i > 0 and word[-1] in VOWEL_LETTERS
            onset = ONSETS[int(rng.integers(len(ONSETS)))] if (needs_onset or rng.random() < 0.75) else ""
            vowel = VOWELS[int(rng.integers(len(VOWELS)))] if rng.random() < 0.15 else VOWEL_LETTERS[
                int(rng.integers(len(VOWEL_LETTERS)))
            ]
            coda = CODAS[int(rng.integers(len(CODAS)))] if (i == n - 1 or rng.random() < 0.35) else ""
            word += onset + vowel + coda
        if 4 <= len(word) <= 9:
            return word.capitalize()


def entity_name(word: str, kind: str) -> str:
    """The display name of an entity: ``"Varnell Observatory"``."""
    return f"{word} {kind.title()}"


def make_person(rng: np.random.Generator) -> str:
    """A founder's name: a generated first and last name."""
    return f"{make_word(rng, (2, 2))} {make_word(rng, (2, 3))}"


def make_cities(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct generated city names, in draw order."""
    cities: list[str] = []
    seen: set[str] = set()
    while len(cities) < n:
        suffix = CITY_SUFFIXES[int(rng.integers(len(CITY_SUFFIXES)))]
        city = make_word(rng, (1, 2) if suffix else (2, 3)) + suffix
        if city not in seen and 4 <= len(city) <= 14:
            seen.add(city)
            cities.append(city)
    return cities


def make_facts(rng: np.random.Generator, cities: list[str], kind: str | None = None) -> Facts:
    """Draw the facts of one entity (``kind`` fixed when given)."""
    if kind is None:
        kind = KINDS[int(rng.integers(len(KINDS)))]
    year = int(rng.integers(YEAR_MIN, YEAR_MAX + 1))
    city = cities[int(rng.integers(len(cities)))]
    return Facts(kind=kind, founded_year=year, city=city, founder=make_person(rng))


def different_facts(rng: np.random.Generator, base: Facts, cities: list[str], kind: str) -> Facts:
    """Facts for a distractor: every fact differs from ``base`` (year, city and founder)."""
    year = base.founded_year
    while year == base.founded_year:
        year = int(np.clip(base.founded_year + int(rng.integers(-80, 81)), YEAR_MIN, YEAR_MAX))
    others = [c for c in cities if c != base.city] or [base.city + "ton"]
    city = others[int(rng.integers(len(others)))]
    founder = base.founder
    while founder == base.founder:
        founder = make_person(rng)
    return Facts(kind=kind, founded_year=year, city=city, founder=founder)


def change_one_letter(rng: np.random.Generator, word: str) -> str:
    """``word`` with exactly one letter (not the first) swapped for another of the same class."""
    lower = word.lower()
    pos = int(rng.integers(1, len(lower)))
    old = lower[pos]
    pool = VOWEL_LETTERS if old in VOWEL_LETTERS else CONSONANT_LETTERS
    choices = [c for c in pool if c != old]
    new = choices[int(rng.integers(len(choices)))]
    return (lower[:pos] + new + lower[pos + 1:]).capitalize()


def distractor_name(rng: np.random.Generator, word: str, kind: str, style: str) -> tuple[str, str, str]:
    """A similar name for a distractor of (``word``, ``kind``).

    ``style`` "letter": one letter of the word changed, same kind ("Varnell Observatory" ->
    "Varnall Observatory"); "shared_word": same word, another kind ("Varnell Foundry").
    Returns (word, kind, name).
    """
    if style == "letter":
        new_word = change_one_letter(rng, word)
        return new_word, kind, entity_name(new_word, kind)
    if style == "shared_word":
        kinds = [k for k in KINDS if k != kind]
        new_kind = kinds[int(rng.integers(len(kinds)))]
        return word, new_kind, entity_name(word, new_kind)
    raise ValueError(f"unknown distractor style {style!r}; expected 'letter' or 'shared_word'")


def article(word: str) -> str:
    """"a" or "an" for ``word``."""
    return "an" if word[:1].lower() in VOWEL_LETTERS else "a"


# Each template states every fact: {name} {kind} {a_kind} {year} {city} {founder}.
TEMPLATES: tuple[str, ...] = (
    "{name} is {a_kind} founded in {year} in {city} by {founder}.",
    "Founded by {founder} in {year}, {name} is {a_kind} based in {city}.",
    "The {kind} known as {name} was established in {city} in {year}. Its founder was {founder}.",
    "{founder} started {name} in {year}. Today the {kind} remains in {city}.",
    "Located in {city}, {name} dates back to {year}, when {founder} founded the {kind}.",
    "In {year}, {founder} founded {name}, {a_kind} in the city of {city}.",
    "{name} ({kind}, {city}) was founded in {year}; the founder was {founder}.",
    "Records show that {name} was founded in {year} by {founder}. The {kind} is in {city}.",
)
FILLERS: tuple[str, ...] = (
    "It is known locally for its annual open day.",
    "Records of its early years are incomplete.",
    "The {kind} has moved buildings twice since then.",
    "Its members meet on the first Monday of each month.",
    "A small exhibition tells its story to visitors.",
    "The {kind} published its first report a few years later.",
    "Many residents of {city} have visited it at least once.",
    "Its archive holds letters written by {founder}.",
)
SECTIONS: tuple[str, ...] = ("overview", "history", "profile", "notes", "records", "summary")


def document_title(name: str, j: int) -> str:
    """Title of the ``j``-th document about ``name`` (the first is the bare name)."""
    return name if j == 0 else f"{name} - {SECTIONS[(j - 1) % len(SECTIONS)]}"


def document_text(rng: np.random.Generator, name: str, facts: Facts, j: int) -> str:
    """One short document stating all of ``facts`` with template ``j``-dependent wording, and up to two fillers."""
    templates = TEMPLATES
    values = {
        "name": name,
        "kind": facts.kind,
        "a_kind": f"{article(facts.kind)} {facts.kind}",
        "year": facts.founded_year,
        "city": facts.city,
        "founder": facts.founder,
    }
    start = int(rng.integers(len(templates)))
    sentences = [templates[(start + j) % len(templates)].format(**values)]
    fillers = list(FILLERS)
    n_fill = int(rng.integers(0, 3))
    for k in rng.permutation(len(fillers))[:n_fill]:
        sentences.append(fillers[int(k)].format(**values))
    text = " ".join(sentences)
    return text[0].upper() + text[1:]


def entity_documents(rng: np.random.Generator, name: str, facts: Facts, n_docs: int) -> list[tuple[str, str]]:
    """``n_docs`` (title, text) documents about one entity, each stating all its facts."""
    return [(document_title(name, j), document_text(rng, name, facts, j)) for j in range(n_docs)]


if __name__ == "__main__":
    g = np.random.default_rng(0)
    towns = make_cities(g, 8)
    for _ in range(5):
        w, f = make_word(g), make_facts(g, towns)
        print(entity_name(w, f.kind), f)
    print(entity_documents(g, "Varnell Observatory", make_facts(g, towns, "observatory"), 2))
