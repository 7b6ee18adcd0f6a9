"""Writes examples/data/tiny_stories.txt: small generated stories for the LM example.

The text is generated (no licence questions) from a tiny grammar with a fixed seed, so
rerunning this script reproduces the shipped file byte for byte. It has enough structure
(names that recur within a story, agreement, fixed phrases) for a small model's loss to fall
well below the unigram entropy within a few hundred steps.
"""

import pathlib
import random

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kai",
         "Lena", "Milo", "Nora", "Omar", "Pia"]
ANIMALS = ["cat", "dog", "fox", "owl", "goat", "horse", "duck", "mouse", "bear", "frog"]
ADJECTIVES = ["small", "old", "brave", "quiet", "happy", "clever", "tired", "curious",
              "gentle", "busy"]
PLACES = ["in the garden", "near the river", "at the market", "by the old mill",
          "on the hill", "under the bridge", "in the forest", "at the harbour"]
OBJECTS = ["a red ball", "a wooden box", "a bag of apples", "a silver key", "a long rope",
           "a blue kite", "a warm coat", "a map of the town", "a basket of bread"]
VERBS = [("finds", "found"), ("carries", "carried"), ("paints", "painted"),
         ("hides", "hid"), ("mends", "mended"), ("sells", "sold"), ("shares", "shared")]
TIMES = ["every morning", "after dinner", "on sunny days", "before the rain",
         "when the bells ring", "at night"]
FEELINGS = ["glad", "surprised", "proud", "sleepy", "hungry", "calm"]


def story(rng: random.Random) -> str:
  name, friend = rng.sample(NAMES, 2)
  adj, animal = rng.choice(ADJECTIVES), rng.choice(ANIMALS)
  place, time = rng.choice(PLACES), rng.choice(TIMES)
  present, past = rng.choice(VERBS)
  obj, other = rng.sample(OBJECTS, 2)
  lines = [
      f"Once there was a {adj} {animal} called {name}.",
      f"{name} lived {place}.",
      f"{time.capitalize()}, {name} {present} {obj}.",
      f"One day {name} met {friend}, who {past} {other}.",
      f"\"Hello, {friend},\" said {name}. \"I am {rng.choice(FEELINGS)} to see you.\"",
      f"{friend} and {name} walked {rng.choice(PLACES)} together.",
      "The end.",
  ]
  return " ".join(lines) + "\n"


def main(size=150_000):
  rng = random.Random(0)
  text = []
  total = 0
  while total < size:
    text.append(story(rng))
    total += len(text[-1])
  out = pathlib.Path(__file__).parent / "data" / "tiny_stories.txt"
  out.write_text("".join(text))
  print(f"wrote {out} ({total} characters)")


if __name__ == "__main__":
  main()
