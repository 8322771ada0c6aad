"""Write ``text.txt``, the corpus of the character-level GPT example (run once; the file
ships with the example, so training needs no download).

The text is generated, not copied: a made-up almanac of a small town, from word lists
and sentence patterns, with a fixed seed. It has the regularities a small character model
picks up in a few hundred steps (spelling, spacing, capitals, punctuation, recurring
phrases) and stays under 200 KB.
"""

from __future__ import annotations

import random
from pathlib import Path

PLACES = ["the mill", "the harbour", "the old bridge", "the market", "the chapel", "the orchard",
          "the school", "the north road", "the lighthouse", "the meadow", "the inn", "the quarry"]
PEOPLE = ["the baker", "the ferryman", "the miller's daughter", "old Tom", "the schoolmaster",
          "the smith", "a travelling tinker", "the widow Ames", "the young clerk", "the fiddler",
          "the shepherd", "the harbour master"]
VERBS = ["walked to", "looked for", "spoke of", "came back from", "dreamed of", "wrote about",
         "sang near", "waited by", "painted", "mended the gate at", "counted sheep near",
         "lost a glove at"]
WEATHER = ["The rain fell softly", "A cold wind came from the sea", "The sun was warm",
           "Fog lay over the water", "Snow covered the hills", "The sky was clear and bright",
           "Thunder rolled in the east", "A light mist hung in the valley"]
TIMES = ["in the morning", "at noon", "in the evening", "before dawn", "after supper",
         "on market day", "at the turn of the tide", "when the bells rang"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
SAYINGS = ["A full barn makes a quiet town.", "Mend the net before the storm.",
           "Bread shared is bread doubled.", "The tide waits for no one.",
           "A kind word costs nothing.", "Slow oxen plough deep furrows."]


def sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return (f"{rng.choice(PEOPLE).capitalize()} {rng.choice(VERBS)} {rng.choice(PLACES)} "
                f"{rng.choice(TIMES)}.")
    if kind < 0.6:
        return f"{rng.choice(WEATHER)} {rng.choice(TIMES)}, and {rng.choice(PEOPLE)} stayed home."
    if kind < 0.8:
        n = rng.randint(2, 40)
        return (f"At {rng.choice(PLACES)} there were {n} "
                f"{rng.choice(['boats', 'lamps', 'sacks of flour', 'geese', 'visitors'])}.")
    if kind < 0.9:
        return f'"{rng.choice(SAYINGS)}" said {rng.choice(PEOPLE)}.'
    return f"{rng.choice(PEOPLE).capitalize()} and {rng.choice(PEOPLE)} met at {rng.choice(PLACES)}."


def main(path: Path = Path(__file__).with_name("text.txt"), size: int = 150_000) -> None:
    rng = random.Random(1234)
    parts: list[str] = []
    total, day = 0, 0
    while total < size:
        month = MONTHS[(day // 28) % 12]
        head = f"\n{month} {day % 28 + 1}.\n"
        body = " ".join(sentence(rng) for _ in range(rng.randint(2, 5))) + "\n"
        parts += [head, body]
        total += len(head) + len(body)
        day += 1
    path.write_text("".join(parts).lstrip("\n")[:size])


if __name__ == "__main__":
    main()
