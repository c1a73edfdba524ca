"""The fixed chat workload and random token-id prompts, shared by
`blockserve bench` and benchmarks/peers/run.py.

64 chat conversations (some with a system prompt, the others get the template's default one),
rendered with the model's chat template (about 15-200 prompt tokens with SmolLM2).
`workload_prompts(tokenizer, n)` takes n of them spread evenly over the prompt-length
distribution, so a quick run keeps the mix of short and long prompts.
"""

from __future__ import annotations

import torch

# --------------------------------------------------------------------------------------------
# The fixed workload: 64 chat conversations, (system prompt or None, user message).
# Short questions, medium instructions and long ones carrying a passage, mixed along the list.
# --------------------------------------------------------------------------------------------

_PASSAGE_TIDES = (
    "Tides are the rise and fall of sea levels caused by the combined effects of the gravitational forces "
    "exerted by the Moon and the Sun, and the rotation of the Earth. Most places in the ocean usually "
    "experience two high tides and two low tides each day, but some locations experience only one high "
    "and one low tide each day. The times and amplitude of tides at a locale are influenced by the "
    "alignment of the Sun and Moon, by the pattern of tides in the deep ocean, and by the shape of the "
    "coastline and near-shore bathymetry."
)
_PASSAGE_BREAD = (
    "Sourdough bread is made by the fermentation of dough using naturally occurring lactobacilli and yeast. "
    "The lactic acid produced by the lactobacilli gives it a more sour taste and improved keeping qualities. "
    "A sourdough starter is a mixture of flour and water that is left to ferment, and it must be fed "
    "regularly with fresh flour and water to stay active. Bakers often keep a starter alive for years, "
    "and some claim that their starters are more than a century old."
)
_PASSAGE_MEETING = (
    "Notes from Tuesday's team meeting: the release of version 2.3 slips by one week because two "
    "integration tests still fail on the ARM build. Priya will own the test fixes and report on Friday. "
    "Marcus proposed moving the documentation site to a static generator; the team agreed to try it on "
    "the API reference first. Budget for the new test machines was approved. The next customer demo is "
    "on the 14th, and Lena asked everyone to freeze the demo branch two days before it."
)
_PASSAGE_CODE = (
    "def merge(a, b):\n"
    "    result = []\n"
    "    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            result.append(a[i]); i += 1\n"
    "        else:\n"
    "            result.append(b[j]); j += 1\n"
    "    return result + a[i:] + b[j:]\n\n"
    "def merge_sort(xs):\n"
    "    if len(xs) <= 1:\n"
    "        return xs\n"
    "    mid = len(xs) // 2\n"
    "    return merge(merge_sort(xs[:mid]), merge_sort(xs[mid:]))\n"
)
_PASSAGE_HISTORY = (
    "The printing press was invented by Johannes Gutenberg around 1440. Using movable metal type, it made "
    "the mass production of books possible for the first time in Europe. Within fifty years, presses were "
    "operating in more than two hundred cities, and millions of volumes had been printed. Historians credit "
    "the press with spreading literacy, standardising languages, and accelerating the exchange of ideas "
    "that fed the Renaissance, the Reformation and the scientific revolution."
)

CONVERSATIONS: list[tuple[str | None, str]] = [
    (None, "What is the capital of France?"),
    ("You are a patient teacher who explains things to children.", "Why is the sky blue? Explain it simply."),
    (None, f"Summarise the following passage in three sentences.\n\n{_PASSAGE_TIDES}"),
    (None, "Write a haiku about autumn leaves."),
    ("Be brief.", "Name three primary colours."),
    (None, "Explain the difference between a list and a tuple in Python, with a short example of each."),
    ("You are an expert Python programmer.", f"Explain what this code does and give its time complexity.\n\n{_PASSAGE_CODE}"),
    (None, "How many legs does a spider have?"),
    (None, "I work from home three days a week in a small flat I share with a partner who is also on calls all day. "
     "I get distracted by chores, my phone and the news, and I often work late to catch up. Give me five "
     "practical tips for staying focused, and say which one I should start with."),
    ("You are a travel agent who loves Italy.", "Plan a three-day trip to Rome for a family with two young children."),
    (None, f"List the decisions and the action items in these meeting notes.\n\n{_PASSAGE_MEETING}"),
    (None, "What does HTTP stand for?"),
    (None, "Translate 'Good morning, how are you today?' into Spanish and German."),
    ("You are a careful math tutor. Show every step.", "Solve for x: 3x + 7 = 22."),
    (None, "Write a short story opening about a lighthouse keeper who finds a message in a bottle."),
    (None, "Is a tomato a fruit or a vegetable?"),
    (None, f"Answer using only the passage: why do starters need to be fed?\n\n{_PASSAGE_BREAD}"),
    ("Answer like a pirate.", "What is the best way to learn to swim?"),
    ("You are a civics teacher preparing a lesson for high-school students.",
     "Describe how a bill becomes a law in the United States, step by step. Mention the committees, the role "
     "of both chambers, what happens when they pass different versions, and the president's options, "
     "including the veto and how Congress can override it."),
    (None, "What is 17 times 23?"),
    (None, "Suggest a name for a small bakery that specialises in cinnamon rolls, and explain the choice."),
    ("You are a helpful assistant that writes concise emails.",
     "Write an email to my landlord asking to fix a leaking kitchen tap this week."),
    (None, f"Write three quiz questions, with answers, based on this passage.\n\n{_PASSAGE_HISTORY}"),
    (None, "Who wrote Pride and Prejudice?"),
    (None, "Explain recursion to someone who has never programmed before."),
    ("Be brief.", "What is photosynthesis?"),
    (None, "I need to travel 500 km from my city to a conference next month. The train takes four and a half "
     "hours and leaves from the city centre; the flight takes one hour but the airport is forty minutes "
     "away and I need to be there early. Compare the two options on total time, cost, comfort, the "
     "chance to work on the way, and the environmental impact, then recommend one."),
    (None, "Write a limerick about a cat who loves to code."),
    ("You are a nutritionist.", "What is a balanced breakfast for someone training for a marathon?"),
    (None, "Convert 100 degrees Fahrenheit to Celsius and show the formula."),
    (None, f"Rewrite the passage for a ten-year-old reader.\n\n{_PASSAGE_TIDES}"),
    (None, "What are the three states of matter?"),
    (None, "Give me a recipe for a simple tomato soup."),
    ("You are a senior software engineer reviewing code.",
     f"Review this code: point out bugs, style problems and possible improvements.\n\n{_PASSAGE_CODE}"),
    (None, "Why do we have leap years?"),
    (None, "My friend Sam has trained for six months for her first half marathon this Sunday. She injured her "
     "ankle in March, nearly gave up, and came back slowly. She is nervous about the hills in the second "
     "half. Write her a short, warm motivational message that mentions her comeback."),
    (None, "What is the largest planet in the solar system?"),
    ("You are a historian.", "What were the main causes of the First World War?"),
    (None, "Explain what a hash table is and why lookups are fast on average."),
    (None, f"What are the risks mentioned in these notes, and who owns each one?\n\n{_PASSAGE_MEETING}"),
    (None, "Tell me a fun fact about octopuses."),
    ("Reply in exactly two sentences.", "What is machine learning?"),
    ("You write short comic scenes.",
     "Write a dialogue between a customer and a shopkeeper about returning a broken umbrella. The customer "
     "lost the receipt, the umbrella broke on its first use in a storm, and the shopkeeper insists that "
     "umbrellas are not designed for wind. Keep it polite but funny, and end with a surprise."),
    (None, "How do vaccines work?"),
    (None, "List the planets of the solar system in order from the Sun."),
    ("You are a friendly gardening expert.", "How often should I water tomato plants in summer, and why?"),
    (None, f"Give this passage a title and list its key points as bullets.\n\n{_PASSAGE_BREAD}"),
    (None, "What is the boiling point of water at sea level?"),
    (None, "Write a product description for an online shop. Product: a 28-litre waterproof hiking backpack, "
     "weight 900 g, roll-top closure, padded laptop sleeve, two side pockets for bottles, a chest strap "
     "with a whistle, reflective details, recycled fabric, available in green, grey and orange. "
     "Audience: weekend hikers who also commute by bike. About 120 words."),
    (None, "Explain the rules of chess in a short paragraph."),
    ("You are a career coach.", "How should I prepare for a job interview at a software company?"),
    (None, "What is the square root of 144?"),
    (None, "Describe the water cycle."),
    (None, f"Was the printing press important? Argue for and against, using the passage.\n\n{_PASSAGE_HISTORY}"),
    ("Be brief.", "Define gravity."),
    (None, "Write a thank-you note to a teacher at the end of the school year."),
    (None, "What are some good habits for getting better sleep?"),
    ("You are a poet.", "Write four lines about the sea at night, with a rhyme in every second line."),
    (None, "Explain the difference between weather and climate."),
    (None, "What is the capital of Japan, and what is it famous for?"),
    (None, "We are a family of five: two adults, a teenager who loves strategy games, a nine-year-old who "
     "hates losing, and a six-year-old who cannot read yet. We have about an hour after dinner. Suggest "
     "three board games that would work for all of us and say why each one is fun."),
    ("You are a physics professor.", "Explain Newton's three laws of motion with an everyday example for each."),
    ("You are a database expert. Answer with SQL and a short explanation.",
     "I have two tables: customers(id, name, country) and orders(id, customer_id, total, created_at). "
     "Write a query that returns, for each country, the customer with the highest total spending in the "
     "last 30 days, with the amount, sorted by amount descending."),
    (None, "Say hello."),
]

def render(conversation: tuple[str | None, str]) -> list[dict]:
    system, user = conversation
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def workload_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """Token ids of `num_prompts` conversations rendered with the chat template: all of them, or
    a subset spread evenly over the prompt-length distribution (kept in list order)."""
    total = len(CONVERSATIONS)
    if not 1 <= num_prompts <= total:
        raise ValueError(f"--num-prompts must be in [1, {total}] (the fixed workload has {total} conversations)")
    prompts = [list(tokenizer.apply_chat_template(render(c), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for c in CONVERSATIONS]
    by_length = sorted(range(total), key=lambda i: (len(prompts[i]), i))
    chosen = sorted(by_length[(2 * j + 1) * total // (2 * num_prompts)] for j in range(num_prompts))
    return [prompts[i] for i in chosen]


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`num_prompts` prompts of `input_len` token ids drawn uniformly from [0, vocab_size)."""
    if num_prompts < 1 or input_len < 1 or vocab_size < 1:
        raise ValueError(f"random prompts need positive sizes, got num_prompts={num_prompts}, "
                         f"input_len={input_len}, vocab_size={vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, input_len), generator=gen).tolist()
