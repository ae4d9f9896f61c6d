"""The chats ``edgepath bench model`` sends: deterministic, of realistic length, distinct in every phase.

A prompt is a short document -- meeting notes, a field report, a support ticket, a travel log -- made
of sentences drawn from templates and word lists by a seeded generator, followed by one instruction
about it ("Summarise ...", "List ...").  Its length in tokens (the model's own tokenizer) is drawn
log-uniformly from a range (128-1,024 by default: short chats are common, long ones exist), and the
text grows sentence by sentence until it reaches that length.  Every phase seeds its own generator
(``seed``, phase name), so no two phases share a document and no prompt cache is fed by an earlier
phase: what all requests have in common is the chat template's own text and a few opening words.

The shared-prefix workload is different on purpose: chats that all start with the same long system
prompt (a company's assistant instructions, ~450 tokens), each followed by its own short question.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

NAMES = (
    "Amira", "Bastien", "Chloe", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ines", "Jonas", "Keiko", "Lars",
    "Maya", "Nikolai", "Olga", "Pedro", "Quentin", "Rosa", "Samir", "Tomas", "Ulla", "Viktor", "Wen", "Yusuf",
)  # fmt: skip
PLACES = (
    "the harbour office", "the north warehouse", "the Lisbon branch", "the river station", "the old mill",
    "the clinic on Elm Street", "the server room", "the visitor centre", "the Tuesday market", "the test kitchen",
    "the mountain hut", "the print shop", "the east wing", "the ferry terminal", "the school library",
)  # fmt: skip
THINGS = (
    "the delivery schedule", "the spare generator", "the new booking form", "the water pump", "the budget draft",
    "the cooling fans", "the visitor survey", "the shipping labels", "the backup tapes", "the seed order",
    "the safety checklist", "the loading ramp", "the heating contract", "the staff rota", "the price list",
    "the bridge sensors", "the coffee machine", "the training plan", "the inventory count", "the roof gutters",
)  # fmt: skip
VERBS = (
    "checked", "replaced", "postponed", "approved", "questioned", "measured", "repaired", "rewrote", "moved",
    "cancelled", "tested", "reviewed", "cleaned", "ordered", "documented", "simplified", "inspected", "priced",
)  # fmt: skip
REASONS = (
    "because the last two attempts had failed", "after a customer complained twice", "to save money before winter",
    "since the supplier changed its terms", "as the inspector had asked in March", "so that the night shift can "
    "work alone", "because nobody could find the old notes", "after the storm flooded the lower floor",
    "to meet the new safety rules", "because the numbers did not add up",
)  # fmt: skip
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
UNITS = ("crates", "litres", "metres", "visitors", "orders", "kilograms", "pages", "boxes", "forms", "calls")
TEMPLATES = (
    "On {day}, {name} {verb} {thing} at {place} {reason}.",
    "{name} says {thing} took {number} hours longer than planned.",
    "At {place}, {thing} is still waiting for {name} to sign it off.",
    "We agreed that {name} will look at {thing} again by {day}.",
    "{name} and {other} disagreed about {thing}; {other} thinks it can wait until {day}.",
    "The team {verb} {thing} {reason}, which cost about {number} euros.",
    "Nobody at {place} had {verb} {thing} for {number} days.",
    "A visitor asked why {thing} was {verb} on {day}, and {name} explained it was {reason}.",
    "{name} counted {number} {unit} at {place} on {day}, fewer than last month.",
    "If {thing} is not {verb} by {day}, {name} will call the supplier.",
    "The note from {place} says {thing} was {verb} {reason}.",
    "{other} wants {thing} {verb} before anyone else at {place} touches it.",
    "By {day} evening {name} had {verb} {thing} and sent photos to {other}.",
    "Two people at {place} reported problems with {thing} this week.",
    "{name} suggested we stop ordering parts for {thing} until {day}.",
    "It is still unclear who {verb} {thing} at {place}; {name} will ask around.",
)  # fmt: skip
KINDS = ("meeting notes", "a field report", "a support ticket", "a shift log", "an incident summary", "a travel log")
INSTRUCTIONS = (
    "Summarise the text above in three sentences.",
    "List the open questions in the text above.",
    "Who has to do what by when, according to the text above?",
    "Write a short, polite email that answers the text above.",
    "What went wrong in the text above, and what should happen next?",
    "Turn the text above into a to-do list with one line per task.",
    "Which numbers in the text above matter most, and why?",
    "Explain the text above to someone who was not there.",
)  # fmt: skip
QUESTIONS = (
    "My order arrived with a broken lid. What can I do?",
    "Can I change the delivery address after paying?",
    "How long does a refund take to reach my card?",
    "Do you ship to Norway, and what does it cost?",
    "The app logs me out every few minutes. Any idea why?",
    "I was charged twice for one order. Please help.",
    "Is the blue kettle back in stock soon?",
    "How do I reset my password without the old email?",
    "Can I return a gift without the receipt?",
    "What is the warranty on the coffee grinder?",
    "My parcel says delivered but I never got it.",
    "Can I pick up my order at the shop instead?",
)  # fmt: skip

#: A count of the tokens of a text in the model's vocabulary (edgepath.edge.text.tokenizer.GGUFTokenizer).
Counter = Callable[[str], int]


def _rng(seed: int, *names: object) -> random.Random:
    """A generator of its own for (seed, names): phases never share a stream of draws."""
    digest = hashlib.sha256(repr((seed, *names)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def sentence(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    return rng.choice(TEMPLATES).format(
        day=rng.choice(DAYS), name=name, other=other, verb=rng.choice(VERBS), thing=rng.choice(THINGS),
        place=rng.choice(PLACES), reason=rng.choice(REASONS), number=rng.randint(2, 480), unit=rng.choice(UNITS),
    )  # fmt: skip


def text_of(rng: random.Random, tokens: int, count: Counter, head: str = "") -> str:
    """``head`` then sentences, in paragraphs of 3-6, until they count ``tokens`` tokens (counted sentence
    by sentence: the whole text's count is within a few tokens of it; servers report the exact one)."""
    paragraphs: list[list[str]] = [[head] if head else []]
    total = count(head) if head else 0
    left = rng.randint(3, 6)
    while total < tokens:
        if left == 0:
            paragraphs.append([])
            left = rng.randint(3, 6)
        line = sentence(rng)
        paragraphs[-1].append(line)
        total += count(line)
        left -= 1
    return "\n\n".join(" ".join(p) for p in paragraphs if p)


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """A length in [low, high], log-uniform: as many prompts between 128 and 256 tokens as between 512 and 1,024."""
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


@dataclass(frozen=True)
class Workload:
    """Every phase's chats, from one seed; ``count`` measures text in the model's tokens."""

    count: Counter
    seed: int = 1
    low: int = 128
    high: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"prompt lengths: need 1 <= low <= high, got {self.low}-{self.high}")

    def chats(self, phase: str, n: int) -> list[list[dict[str, str]]]:
        """``n`` single-message chats for ``phase``: a document of a drawn length and an instruction."""
        rng = _rng(self.seed, "chats", phase)
        out = []
        for _ in range(n):
            target = log_uniform(rng, self.low, self.high)
            instruction = rng.choice(INSTRUCTIONS)
            head = f"The following is {rng.choice(KINDS)} from {rng.choice(PLACES)}."
            body = text_of(rng, max(1, target - self.count(instruction) - 2), self.count, head)
            out.append([{"role": "user", "content": f"{body}\n\n{instruction}"}])
        return out

    def system_prompt(self, phase: str, tokens: int = 450) -> str:
        """A company assistant's long instructions: the prefix the shared-prefix chats have in common."""
        rng = _rng(self.seed, "system", phase)
        company = f"{rng.choice(NAMES)} & {rng.choice(NAMES)} Home Goods"
        head = (
            f"You are the customer assistant of {company}. Answer briefly and politely, in the customer's "
            "language. Never promise refunds the rules below do not allow. The following are internal notes "
            "from our branches; use them only when they help with the question."
        )
        return text_of(rng, tokens, self.count, head)

    def shared_prefix(self, phase: str, n: int, tokens: int = 450) -> list[list[dict[str, str]]]:
        """``n`` chats that share one ``tokens``-long system prompt, each with its own question."""
        system = self.system_prompt(phase, tokens)
        rng = _rng(self.seed, "questions", phase)
        out = []
        for i in range(n):
            question = QUESTIONS[i % len(QUESTIONS)]
            detail = f" (order {rng.randint(10_000, 99_999)}, {rng.choice(NAMES)})"
            out.append([{"role": "system", "content": system}, {"role": "user", "content": question + detail}])
        return out
