"""The editing tasks of the n-gram benchmarks (bench/speculative.py's workload (a)): rewrite a given
text with one substitution, or fix its typos. The answer copies long spans of the prompt, what
prompt lookup is made for, and ends at the model's EOS. No imports beyond the standard library:
tests use these tasks too (`from bench.editing_tasks import tasks`).
"""

from __future__ import annotations

import random

# Editing tasks over given texts, long enough (~120-150 tokens) that the edited copy, not the
# model's own text, fills most of a 128-token answer. SmolLM2-135M copies the texts (partly: it
# drops or merges clauses, and often leaves the word to replace unchanged); asked to rename a
# variable in Python code it wrote new code instead, so no code task here (bench/NOTES.md).
TEXTS = [
    "The town council met on Monday evening to discuss the new budget for the coming year. Most of "
    "the money will go to the schools, the roads and the public library, which has asked for longer "
    "opening hours and more staff. The mayor said that the roads in the north of the town are in poor "
    "condition and must be repaired before the winter. Several residents spoke at the meeting and "
    "asked the council to build a new playground near the river. The council agreed to study the "
    "proposal and to present a plan at the next meeting, which will take place on Monday, the third "
    "of March, at seven in the evening.",
    "Our train leaves the central station at nine in the morning and arrives at the coast shortly "
    "after noon. On the way it stops in three small towns, where passengers can buy coffee and "
    "sandwiches on the platform. The last stop is a quiet harbor with a white lighthouse, a fish "
    "market and a few restaurants that serve fresh seafood. From the harbor a ferry goes to the "
    "island twice a day, once at two in the afternoon and once at six in the evening. Tickets for "
    "the ferry can be bought at the harbor office, which is open every day except Sunday.",
    "To make the vegetable soup, cut two onions, three carrots and four potatoes into small pieces. "
    "Melt some butter in a large pot and cook the onions for five minutes, until they are soft. Add "
    "the carrots and the potatoes, pour in two liters of water and add a spoon of salt. Bring the "
    "soup to a boil, then lower the heat and let it simmer for thirty minutes, stirring from time to "
    "time. When the vegetables are tender, blend the soup until it is smooth, taste it and add more "
    "salt or pepper if needed. Serve the soup hot with fresh bread and a little cream on top.",
    "The city library opens at eight in the morning and closes at six in the evening from Monday to "
    "Friday. On Saturday it opens at ten and closes at four. Visitors with a library card may borrow "
    "up to five books at a time, and books must be returned within three weeks. If a book is "
    "returned late, the library charges a small fee for each day. Children under twelve can borrow "
    "books for free and may join the reading club, which meets every Wednesday afternoon in the room "
    "next to the entrance. The library also offers free internet access and a quiet room for study.",
]
EDITS = [("Monday", "Tuesday"), ("ferry", "boat"), ("carrots", "leeks"), ("library", "archive")]


def with_typos(text: str, seed: int) -> str:
    """The text with adjacent letters swapped in about one word of five longer than five letters."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 5 and word.isalpha() and rng.random() < 0.2:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def tasks(num: int) -> list[str]:
    """Each text once with a replacement to make, then once with typos to fix; then again."""
    out = []
    for i in range(num):
        t = i % len(TEXTS)
        if (i // len(TEXTS)) % 2 == 0:
            old, new = EDITS[t]
            out.append(f"Rewrite the following text, replacing '{old}' with '{new}'. Text: {TEXTS[t]}")
        else:
            out.append(
                "Fix the spelling mistakes in the following text and return the corrected text. "
                f"Text: {with_typos(TEXTS[t], t)}"
            )
    return out
