"""A model-free front for the async Engine's unit tests: a real byte-level tokenizer with a
ChatML template, and a NullRunner that carries what the Engine reads from a runner."""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from service.core.null_runner import NullRunner

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = 2  # <|im_end|>


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (ids 3..258) plus the three ChatML control tokens (ids 0..2)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  bos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    tok.chat_template = CHATML
    return tok


class TinyRunner(NullRunner):
    """A NullRunner that the async Engine can front (tokenizer, vocab, EOS, name). By
    default every request's completion reads "abcdefghijklmnopqrstuvwxyzabc..."."""

    def __init__(self, token_fn: Callable[[str, int], int] | None = None,
                 num_blocks: int = 1024, max_model_len: int = 2048, **kw) -> None:
        self.tokenizer = byte_tokenizer()
        letters = [self.tokenizer.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"]
        super().__init__(num_blocks, max_model_len=max_model_len,
                         token_fn=token_fn or (lambda rid, pos: letters[pos % 26]), **kw)
        self.letter_ids = letters
        self.vocab_size = len(self.tokenizer)
        self.eos_token_ids = frozenset({EOS})
        self.model_name = "tiny-bytes"
        self.kv_bytes_per_block = 1024
