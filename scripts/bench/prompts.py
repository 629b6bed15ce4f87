"""Bundled prompt sets, reproducible by seed: snippets of held-out stdlib source, and
everyday chat questions (`chat_questions`) for an instruct model, where prompt lookup
rarely finds a draft.

The bundled pair was trained on the standard library with every 20th file held out
(`models.corpus.split_corpus`); prompts come from those held-out files, so they are
in-distribution for the bundled models without being memorized training text. A
prompt is the `num_chars` characters starting at a line boundary of a file chosen by
`random.Random(seed)`; the same seed and Python version give the same prompts.

The `training_*` sets feed `scripts.tools.train_draft`: code from the training side of that
split, and chat questions whose topics, phrasings and tasks share none with
`chat_questions`, so a draft trained on them is evaluated on prompts it never saw.
"""

from __future__ import annotations

import functools
import random


@functools.lru_cache(maxsize=2)
def _corpus_files(side: str) -> tuple[str, ...]:
    """The long files (> 4000 characters) of one side ("train" or "valid") of the split."""
    from models.corpus import split_corpus

    train, valid = split_corpus()
    return tuple(text for text in (train if side == "train" else valid) if len(text) > 4000)


def stdlib_snippets(num_prompts: int, seed: int = 0, num_chars: int = 600) -> list[str]:
    """`num_prompts` code snippets of about `num_chars` characters each."""
    return _snippets(_corpus_files("valid"), num_prompts, seed, num_chars)


def _snippets(files: tuple[str, ...], num_prompts: int, seed: int, num_chars: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        text = files[rng.randrange(len(files))]
        start = rng.randrange(0, max(1, len(text) - num_chars - 1))
        newline = text.find("\n", start)
        start = newline + 1 if 0 <= newline < len(text) - num_chars else start
        prompts.append(text[start : start + num_chars])
    return prompts


def sized_snippets(codec, num_prompts: int, seed: int = 0, num_tokens: int = 2048) -> list[str]:
    """`num_prompts` code texts of `num_tokens` tokens each as `codec` (a
    `serve_app.openai.codec.TextCodec`) tokenizes them, give or take the token at the cut
    (re-encoding a text cut at a token boundary can merge its last tokens): a line
    naming the prompt first, so no two share a prefix, then snippets until the length."""
    encoded = [codec.encode(t) for t in stdlib_snippets(num_prompts, seed, num_chars=num_tokens * 6)]
    out = []
    for i in range(num_prompts):
        ids, k = codec.encode(f"# prompt {seed}-{i}\n"), i
        while len(ids) < num_tokens:
            ids += encoded[k % num_prompts]
            k += 1
        out.append(codec.decode(ids[:num_tokens]))
    return out


def chat_messages(num_prompts: int, seed: int = 0, num_chars: int = 600) -> list[list[dict]]:
    """The same snippets as chat requests asking to continue the code."""
    return [
        [{"role": "user", "content": "Continue this Python code:\n" + s}]
        for s in stdlib_snippets(num_prompts, seed, num_chars)
    ]


def token_prompts(tokenizer, num_prompts: int, seed: int = 0, num_tokens: int = 128) -> list[list[int]]:
    """Token-id prompts of exactly `num_tokens` tokens (for the engine benchmark)."""
    prompts = []
    for text in stdlib_snippets(num_prompts, seed, num_chars=num_tokens * 6):
        ids = tokenizer.encode(text)
        prompts.append(list(ids[:num_tokens]))
    return prompts


_TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "volcanoes",
    "machine learning",
    "the immune system",
    "climate change",
    "the printing press",
    "honey bees",
    "the stock market",
    "plate tectonics",
    "the Roman Empire",
    "electric cars",
    "sleep",
    "the moon landing",
    "coral reefs",
    "vaccines",
    "the internet",
    "rainbows",
    "jazz music",
    "the Great Wall of China",
    "recycling",
    "earthquakes",
)
_ASKS = (
    "Explain {} in simple terms.",
    "What are three interesting facts about {}?",
    "Write a short paragraph about {} for a ten-year-old.",
    "Why does {} matter?",
    "Give me a brief history of {}.",
    "What are common misconceptions about {}?",
    "Write a short poem about {}.",
    "Summarize what scientists know about {}.",
)


def chat_questions(num_prompts: int, seed: int = 0) -> list[list[dict]]:
    """`num_prompts` one-turn chats asking an everyday question (topic x phrasing,
    chosen by `random.Random(seed)`): answers are prose, not copies of the prompt."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": rng.choice(_ASKS).format(rng.choice(_TOPICS))}] for _ in range(num_prompts)]


# Training-side chat material for `scripts.tools.train_draft`: no topic, phrasing or task here
# appears in `_TOPICS` / `_ASKS`, so `chat_questions` stays a held-out evaluation set.
_TRAIN_TOPICS = (
    "glaciers",
    "the human heart",
    "tides",
    "the Silk Road",
    "octopuses",
    "solar panels",
    "bread baking",
    "the periodic table",
    "ancient Egypt",
    "wind turbines",
    "the Renaissance",
    "tornadoes",
    "DNA",
    "the Amazon rainforest",
    "chess",
    "the Industrial Revolution",
    "penguins",
    "nuclear fusion",
    "the Olympic Games",
    "deserts",
    "compound interest",
    "the human brain",
    "migratory birds",
    "the theory of evolution",
    "batteries",
    "the Cold War",
    "mushrooms",
    "lighthouses",
    "gravity",
    "the Pacific Ocean",
    "public libraries",
    "antibiotics",
    "the solar system",
    "origami",
    "the Eiffel Tower",
    "coffee",
    "rivers",
    "the Vikings",
    "telescopes",
    "dinosaurs",
    "the metric system",
    "hurricanes",
    "bicycles",
    "the Ottoman Empire",
    "wolves",
    "the speed of light",
    "fermentation",
    "the Moon's phases",
    "bridges",
    "the Aztecs",
    "democracy",
    "snowflakes",
    "the Mars rovers",
    "inflation",
    "elephants",
    "the Byzantine Empire",
    "3D printing",
    "photosynthetic algae",
    "the Sahara",
    "sourdough",
    "the Hubble telescope",
    "ant colonies",
    "the Apollo program",
    "rain forests of Borneo",
    "the human skeleton",
    "submarines",
    "ocean currents",
    "cryptography",
    "the first airplanes",
    "mountain formation",
    "tea",
    "the Mongol Empire",
    "quantum computers",
    "whales",
    "the Panama Canal",
    "auroras",
    "spices",
    "the Great Barrier Reef",
    "radio waves",
    "medieval castles",
    "sharks",
    "the printing of money",
    "the water supply of cities",
    "meteors",
    "the Inca road system",
    "vitamin D",
    "trains",
    "the history of writing",
    "fungi in forests",
    "solar eclipses",
    "the Dead Sea",
    "artificial satellites",
    "the Stone Age",
    "kangaroos",
    "public transport",
    "the ozone layer",
    "microplastics",
    "paper making",
    "the violin",
    "supply and demand",
    "the Arctic",
    "hydroelectric dams",
    "the Black Death",
    "sunflowers",
)
_TRAIN_ASKS = (
    "Tell me about {}.",
    "What is the most surprising thing about {}?",
    "Describe {} in two sentences.",
    "How would you explain {} to a friend?",
    "Write an encyclopedia-style introduction to {}.",
    "What questions do people often ask about {}?",
    "List five key facts about {}.",
    "Write a haiku about {}.",
    "How has our understanding of {} changed over time?",
    "What should a beginner know about {}?",
    "Compare {} with something from everyday life.",
    "Write a short story that involves {}.",
    "What are the pros and cons of {}?",
    "Give a step-by-step overview of how {} works.",
    "Why do people find {} fascinating?",
    "Write a quiz question about {} and answer it.",
    "Explain {} as if I were a high school student.",
    "What is a good analogy for {}?",
    "Write a tweet about {}.",
    "What would happen without {}?",
)
_TRAIN_STYLES = (
    "",
    "",
    "",
    " Keep it short.",
    " Use bullet points.",
    " Answer in one paragraph.",
    " Be precise.",
    " Use simple words.",
)
_TRAIN_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text",
    "merges two sorted lists",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list",
    "parses a date in ISO format",
    "computes the mean and median of a list",
    "flattens a nested list",
    "validates an email address with a regular expression",
    "reads a CSV file into dictionaries",
    "finds the longest common prefix of some strings",
    "converts Celsius to Fahrenheit",
    "implements binary search",
    "groups words by their first letter",
    "computes a factorial iteratively",
    "checks whether a string is a palindrome",
    "transposes a matrix",
    "counts vowels in a string",
    "returns the k largest numbers of a list",
    "implements a stack class",
    "shuffles a deck of cards",
    "computes the greatest common divisor",
    "writes a dictionary to a JSON file",
    "splits a list into chunks of size n",
    "rotates a list by k positions",
    "sums the digits of a number",
)
_TRAIN_CODE_ASKS = (
    "Write a Python function that {}.",
    "Show me Python code that {}.",
    "How do I write a function in Python that {}?",
    "Write a short Python script that {}.",
)
_TRAIN_SNIPPET_ASKS = (
    "Continue this Python code:\n",
    "Explain what this code does:\n",
    "Add comments to this code:\n",
    "Are there any bugs in this code?\n",
    "Summarize this Python code in a few sentences:\n",
)


def training_chat_questions(num_prompts: int, seed: int = 0) -> list[list[dict]]:
    """`num_prompts` one-turn chats for draft training: four in five ask about a topic
    (topic x phrasing x style), one in five asks for a small Python function; chosen by
    `random.Random(seed)`. None equals a `chat_questions` prompt."""
    rng = random.Random(seed)
    chats = []
    for _ in range(num_prompts):
        if rng.random() < 0.8:
            text = rng.choice(_TRAIN_ASKS).format(rng.choice(_TRAIN_TOPICS)) + rng.choice(_TRAIN_STYLES)
        else:
            text = rng.choice(_TRAIN_CODE_ASKS).format(rng.choice(_TRAIN_TASKS))
        chats.append([{"role": "user", "content": text}])
    return chats


def training_snippets(num_prompts: int, seed: int = 0, num_chars: int = 600) -> list[str]:
    """`stdlib_snippets` from the training side of the split (no held-out file)."""
    return _snippets(_corpus_files("train"), num_prompts, seed, num_chars)


def training_code_messages(num_prompts: int, seed: int = 0, num_chars: int = 600) -> list[list[dict]]:
    """Training-side snippets as chat requests (continue, explain, comment, review, summarize)."""
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": rng.choice(_TRAIN_SNIPPET_ASKS) + s}]
        for s in training_snippets(num_prompts, seed, num_chars)
    ]
