"""The text the quality gate of 16-bit compute scores (``quality_gate``): the calibration
chat turn and text (``smoothing.calibration_token_ids``, about 480 tokens on SmolLM2), then
GATE_TEXT (about 560 more): some 1,000 positions, so that one argmax that moves is 0.1%.

Written for Conveyor (plain English prose, a dialogue, a recipe, a table and a little code),
kept apart from the texts the accuracy benchmark scores (``service.bench.texts``).
"""

from __future__ import annotations

from typing import Any

from service.worker.quantization.smoothing import calibration_token_ids

GATE_TEXT = (
    "\n\nThe village library opened an hour late on Tuesday because the heating had failed "
    "overnight. By ten o'clock the reading room was warm again, and the regulars returned "
    "to their usual chairs: the retired teacher with her crossword, two students revising "
    "for an exam in organic chemistry, and a man who came every week to read the shipping "
    "news from newspapers printed a century ago. The librarian kept a kettle behind the "
    "desk and a list of everyone who had borrowed the atlas, which was always overdue.\n\n"
    "\"Are you sure the bridge is closed?\" asked Mira.\n"
    "\"Closed since Monday,\" said the driver. \"They found a crack in one of the piers. "
    "We go round by the old mill road now; it adds twenty minutes, maybe more if the "
    "tractors are out.\"\n"
    "\"Then I will miss the train.\"\n"
    "\"Not if we leave now. The eight-fifteen is always late on market days.\"\n\n"
    "Lentil soup for four: soften one chopped onion, two carrots and a stick of celery in "
    "olive oil for ten minutes. Add two cloves of garlic, a teaspoon of cumin and 250 grams "
    "of red lentils, then a litre of stock. Simmer for twenty-five minutes, until the "
    "lentils have collapsed, season with salt, pepper and the juice of half a lemon, and "
    "blend half of it if you like a thicker soup.\n\n"
    "| city | population | founded |\n"
    "|---|---|---|\n"
    "| Lyon | 522,000 | 43 BC |\n"
    "| Porto | 232,000 | 300 BC |\n"
    "| Kraków | 804,000 | 7th century |\n\n"
    "def count_words(path):\n"
    "    counts = {}\n"
    "    with open(path) as f:\n"
    "        for line in f:\n"
    "            for word in line.lower().split():\n"
    "                counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda kv: -kv[1])[:10]\n\n"
    "Bees find their way home by the sun, even on cloudy days, because they see the "
    "polarisation of light that passes through the clouds. A forager that has found a rich "
    "patch of flowers returns to the hive and dances: the angle of her run against the "
    "vertical comb gives the direction of the flowers relative to the sun, and the length "
    "of the run gives the distance. Her sisters follow her, taste the nectar she carries, "
    "and fly out to the same place. In a good summer a strong colony brings in more than a "
    "kilogram of nectar a day, most of which becomes honey as the water evaporates in the "
    "warm air that the workers fan through the combs."
)


def gate_token_ids(tokenizer: Any, limit: int) -> list[int]:
    """Token ids of the gate's text, at most `limit` (the KV cache's and the model's
    context)."""
    ids = calibration_token_ids(tokenizer)
    ids += tokenizer.encode(GATE_TEXT, add_special_tokens=False)
    return ids[:limit]
