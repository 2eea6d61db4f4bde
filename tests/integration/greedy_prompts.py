"""Short text openings whose greedy continuations the real-model tests compare
(transformers vs ours in test_oracle, int8 vs fp32 in test_int8)."""

GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Water boils at a temperature of",
]
