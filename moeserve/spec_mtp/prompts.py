"""Chat instructions for training and measuring NextN draft heads.

Prompts are templates x subjects. The training split and the held-out split use disjoint
subject lists, so a head is measured (and the serving benchmark run) on requests whose subjects
it never saw while it was trained. The templates are shared on purpose: a template only fixes the
shape of an answer, and chat traffic repeats those shapes. Both splits are deterministic lists of
user messages; chat-templating them is the caller's job, because only the target's tokenizer
knows its template.
"""

from __future__ import annotations

import random

# "{}" takes a subject (a noun phrase that reads well in every template).
TOPIC_TEMPLATES = (
    "Explain {} in simple terms.",
    "Give me three interesting facts about {}.",
    "Write a short poem about {}.",
    "Write a short story that involves {}.",
    "What are the main advantages and disadvantages of {}?",
    "Summarize the history of {} in one paragraph.",
    "How would you explain {} to a ten-year-old?",
    "What are some common misconceptions about {}?",
    "Write five quiz questions about {}, with answers.",
    "Write a friendly email to a colleague about {}.",
    "Write the opening paragraph of a blog post about {}.",
    "What should a beginner learn first about {}?",
    "Describe {} to someone who has never heard of it.",
    "List the key terms someone should know about {} and define each one.",
    "Why do people find {} interesting?",
    "Write a haiku about {} and then explain it.",
    "Compare {} with something from everyday life.",
    "What questions are researchers still asking about {}?",
    "Give a step-by-step plan for a weekend project related to {}.",
    "Write a short dialogue between a teacher and a student about {}.",
)

TRAIN_TOPICS = (
    "photosynthesis", "volcanoes", "the French Revolution", "machine learning", "coffee",
    "the water cycle", "black holes", "the Roman Empire", "electric cars", "honeybees",
    "the human heart", "jazz music", "climate change", "the internet", "chess",
    "the Great Wall of China", "vaccines", "recycling", "the stock market", "dinosaurs",
    "solar panels", "the Olympic Games", "gardening", "earthquakes", "the printing press",
    "rainforests", "friendship", "public libraries", "bread baking", "the Moon landing",
    "renewable energy", "the immune system", "ancient Egypt", "coral reefs", "video games",
    "sleep", "the Renaissance", "rivers", "bicycles", "cloud computing",
    "penguins", "democracy", "tea", "the periodic table", "robots",
    "time zones", "mountains", "the violin", "photography", "the Vikings", "deserts",
    "electric guitars", "trains", "the ocean tides", "yoga", "the camera obscura",
    "wind turbines", "ants", "the Amazon River", "public speaking", "pizza", "satellites",
    "the Ice Age", "kindness", "museums", "rice farming", "sharks", "the telephone",
    "marathons", "the Milky Way", "bees and flowers", "castles", "soap", "the Eiffel Tower",
    "fireworks", "owls",
    "the Pyramids of Giza", "hurricanes", "the printing of money", "elephants", "astronomy",
    "the piano", "submarines", "bridges", "the Greek myths", "composting", "airplanes",
    "the Sahara", "whales", "the human skeleton", "nutrition", "the Apollo program", "maps",
    "knitting", "the Arctic", "vitamins", "the Mona Lisa", "skyscrapers", "spiders",
    "the theory of evolution", "cheese making", "rain", "the compass", "wolves", "volunteering",
    "the Great Barrier Reef", "lightning", "ancient Rome's aqueducts", "smartphones", "butterflies",
    "the French language", "geometry", "the Samurai", "batteries", "hiking", "the Nile",
    "magnets", "the Beatles", "frogs", "budgeting", "nuclear power", "the Aztecs", "kites",
    "weather forecasting", "the lungs", "poetry", "rockets", "the Dead Sea", "camels",
    "social media", "the Northern Lights", "gravity", "ballet", "the Mayan calendar",
    "sourdough", "hummingbirds", "3D printing", "the Statue of Liberty", "sunflowers",
    "board games", "the speed of light", "opera", "clocks", "the Himalayas", "DNA",
    "sea turtles",
)

HELDOUT_TOPICS = (
    "tornadoes", "the Silk Road", "octopuses", "cryptography", "chocolate",
    "the Industrial Revolution", "glaciers", "origami", "the human brain", "lighthouses",
    "mushrooms", "the metric system",
)

# "{}" takes a programming task.
CODE_TEMPLATES = (
    "Write a Python function that {}.",
    "Explain how you would write a program that {}, then show the code.",
    "Write a JavaScript function that {} and explain how it works.",
)

TRAIN_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "returns the largest element of a list", "computes the factorial of a number",
    "removes duplicates from a list", "converts Celsius to Fahrenheit",
    "checks whether a word is a palindrome", "sums the digits of an integer",
    "sorts a list of names alphabetically", "finds the average of a list of numbers",
    "counts how often each word appears in a text", "merges two sorted lists",
    "returns the Fibonacci numbers below a limit", "capitalizes the first letter of every word",
    "checks whether two strings are anagrams", "counts the lines in a text file",
    "finds the common elements of two lists", "rounds a price to two decimals",
    "splits a sentence into words", "computes the greatest common divisor of two numbers",
)

HELDOUT_TASKS = (
    "finds the second smallest number in a list", "converts a binary string to an integer",
    "checks whether a year is a leap year", "returns the longest word in a sentence",
)

# Short arithmetic word problems: numbers vary, the split is by template.
TRAIN_MATH = (
    "A train travels {a} kilometers in {b} hours. What is its average speed? Explain each step.",
    "Sara has {a} apples and gives away {b}. How many are left? Show your reasoning.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If a book costs {a} dollars and is sold at a {b} percent discount, what is the new price?",
)

HELDOUT_MATH = (
    "A tank holds {a} liters and {b} liters leak out every hour. How long until it is empty?",
)


def _math(templates: tuple[str, ...], rng: random.Random, per_template: int) -> list[str]:
    out = []
    for template in templates:
        for _ in range(per_template):
            out.append(template.format(a=rng.randint(12, 240), b=rng.randint(2, 11)))
    return out


def _split(topics, tasks, math, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = [t.format(s) for s in topics for t in TOPIC_TEMPLATES]
    prompts += [t.format(s) for s in tasks for t in CODE_TEMPLATES]
    prompts += _math(math, rng, per_template=6)
    rng.shuffle(prompts)
    return prompts


def train_prompts(seed: int = 0) -> list[str]:
    """All training user messages (~3000), shuffled by `seed`; take a prefix for a smaller set."""
    return _split(TRAIN_TOPICS, TRAIN_TASKS, TRAIN_MATH, seed)


def heldout_prompts(n: int | None = 32) -> list[str]:
    """Held-out user messages: subjects, tasks and math templates that training never sees.

    The order is fixed (seeded), so `heldout_prompts(n)` is the same list in the trainer's
    evaluation and in the serving benchmark. n=None returns all of them (~260).
    """
    prompts = _split(HELDOUT_TOPICS, HELDOUT_TASKS, HELDOUT_MATH, seed=1234)
    return prompts if n is None else prompts[:n]


def read_prompts(path: str) -> list[str]:
    """User messages from a file: one per line, or a JSON list of strings (a .json file)."""
    import json

    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
                raise ValueError(f"{path}: expected a JSON list of strings")
            return data
        return [line.strip() for line in f if line.strip()]
